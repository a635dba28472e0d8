"""``roberta_alibi``: a RoBERTa masked-LM encoder with bidirectional ALiBi.

Against the stock ``roberta`` model only this changes:

* the sentence encoder has no position embeddings (the state dict holds no
  position table; with ``--alibi-bidirectional learned`` it holds each layer's
  two slope vectors instead), and the model does not cap the input length
  (``max_positions`` is unbounded unless ``--max-positions`` is given; the
  ``masked_lm`` task still blocks its data by ``--tokens-per-sample``);
* every encoder self-attention is bidirectional ALiBi (``symmetric``, ``split``
  or ``learned``, see ``bidirectional.py``);
* ``alibi_train_length`` defaults to the task's ``tokens_per_sample`` and is
  stored resolved, so dynamic interpolation works on a reloaded checkpoint.

Architectures: ``roberta_alibi`` (= base), ``roberta_alibi_base``,
``roberta_alibi_large`` and ``roberta_alibi_prenorm``, twins of the stock ones.
"""

from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import ARCH_CONFIG_REGISTRY, register_model, register_model_architecture
from fairseq.models.roberta import model as stock
from omegaconf import OmegaConf

from .. import facts
from .bidirectional import AlibiTransformerEncoder, encoder_twin
from .config import AlibiEncoderConfig


class AlibiRobertaEncoder(stock.RobertaEncoder):
    """RoBERTa encoder whose sentence encoder is the ALiBi encoder."""

    def build_encoder(self, args, dictionary, embed_tokens):
        encoder = AlibiTransformerEncoder(args, dictionary, embed_tokens)
        encoder.apply(stock.init_bert_params)
        return encoder


@register_model("roberta_alibi")
class AlibiRobertaModel(stock.RobertaModel):
    @classmethod
    def hub_models(cls):
        return {}

    @staticmethod
    def add_args(parser):
        stock.RobertaModel.add_args(parser)
        gen_parser_from_dataclass(parser, AlibiEncoderConfig())

    @classmethod
    def build_model(cls, args, task):
        if OmegaConf.is_config(args):
            OmegaConf.set_struct(args, False)
        roberta_alibi_architecture(args)
        if getattr(args, "max_positions", None) is None:
            args.max_positions = facts.UNBOUNDED_POSITIONS
            args.max_source_positions = facts.UNBOUNDED_POSITIONS
        facts.resolve_train_length(args, task)
        encoder = AlibiRobertaEncoder(args, task.source_dictionary)
        if OmegaConf.is_config(args):
            OmegaConf.set_struct(args, True)
        return cls(args, encoder)


def _twin(stock_arch_fn):
    return encoder_twin(stock_arch_fn, "encoder_learned_pos")


roberta_alibi_architecture = register_model_architecture("roberta_alibi", "roberta_alibi")(
    _twin(stock.base_architecture)
)
TWINS = {
    "roberta_base": "roberta_alibi_base",
    "roberta_large": "roberta_alibi_large",
    "roberta_prenorm": "roberta_alibi_prenorm",
}
for _stock_name, _twin_name in TWINS.items():
    register_model_architecture("roberta_alibi", _twin_name)(_twin(ARCH_CONFIG_REGISTRY[_stock_name]))
