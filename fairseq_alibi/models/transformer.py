"""``transformer_alibi``: fairseq's encoder-decoder transformer with ALiBi.

* encoder self-attention: bidirectional ALiBi (``--alibi-bidirectional``
  ``symmetric`` | ``split`` | ``learned``), no position embeddings;
* decoder self-attention: the core plugin's causal ALiBi (one shared
  causal ``AlibiBias`` per stack, KV cache exact), no position
  embeddings;
* encoder-decoder attention: stock ``MultiheadAttention``, no position
  information at all;
* the model caps neither length (its ``max_positions`` is unbounded); the
  translation task's own ``--max-source-positions`` / ``--max-target-positions``
  (default 1024) still filter the data, raise them to evaluate longer inputs.

The interpolation fields apply to both stacks, each resolving its factor from
its own key length.  With dynamic scaling (factor 0) the decoder's slopes
change while it generates, so its KV cache is no longer exact; use a static
factor when that matters (the LM has the same caveat).

Every stock ``transformer*`` architecture of model ``transformer`` gets an
``<arch>_alibi`` twin (``transformer`` -> ``transformer_alibi``).
"""

from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import ARCH_CONFIG_REGISTRY, register_model, register_model_architecture
from fairseq.models.transformer import TransformerModel

from .. import facts
from .bidirectional import AlibiTransformerEncoder, encoder_twin
from .config import AlibiEncoderConfig
from .transformer_lm import PositionTransformerDecoder


@register_model("transformer_alibi")
class AlibiTransformerModel(TransformerModel):
    @classmethod
    def hub_models(cls):
        return {}

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        gen_parser_from_dataclass(parser, AlibiEncoderConfig())

    @classmethod
    def build_model(cls, args, task):
        transformer_alibi_architecture(args)
        for name in ("max_source_positions", "max_target_positions"):
            if getattr(args, name, None) is None:
                setattr(args, name, facts.UNBOUNDED_POSITIONS)
        return super().build_model(args, task)

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return AlibiTransformerEncoder(args, src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        return PositionTransformerDecoder(
            args, tgt_dict, embed_tokens, no_encoder_attn=getattr(args, "no_cross_attention", False)
        )


def _twin(stock_arch_fn):
    return encoder_twin(stock_arch_fn, "encoder_learned_pos", "decoder_learned_pos")


# "transformer" -> "transformer_alibi", "transformer_iwslt_de_en" ->
# "transformer_iwslt_de_en_alibi", ... for every arch of the stock model.
transformer_alibi_architecture = register_model_architecture("transformer_alibi", "transformer_alibi")(
    _twin(ARCH_CONFIG_REGISTRY["transformer"])
)
for _name in facts.stock_archs("transformer"):
    if _name != "transformer" and _name.startswith("transformer"):
        register_model_architecture("transformer_alibi", facts.twin_name(_name))(_twin(ARCH_CONFIG_REGISTRY[_name]))
