"""``alibi-user-dir``: print the plugin's directory for ``--user-dir``.

Outside the package on purpose: importing ``fairseq_alibi`` imports fairseq
(seconds); finding its directory does not.
"""

import importlib.util
import sys


def main() -> int:
    if sys.argv[1:] in (["-h"], ["--help"]):
        sys.stdout.write("usage: alibi-user-dir\n\nPrints the plugin's directory, for a stock fairseq command's "
                         "--user-dir \"$(alibi-user-dir)\".\n")
        return 0
    if sys.argv[1:]:
        sys.stderr.write(f"error: alibi-user-dir takes no arguments ({' '.join(sys.argv[1:])} given): it prints the "
                         "plugin's directory, for --user-dir \"$(alibi-user-dir)\"\n")
        return 1
    spec = importlib.util.find_spec("fairseq_alibi")
    if spec is None or not spec.submodule_search_locations:
        sys.stderr.write("error: fairseq_alibi is not installed in this Python; run `make install`\n")
        return 1
    sys.stdout.write(list(spec.submodule_search_locations)[0] + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
