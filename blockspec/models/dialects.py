"""The published dialects of DFlash-family drafter checkpoints, each read into the one form the
drafter kinds read (`blockspec.models.dflash.dflash_value`): the layers' geometry at the top level,
the drafter's fields in `dflash_config` or at the top level, and tensor names as our modules'. The
row convention is the drafter kind's (`DFlashDrafter.shifted_by_default`) unless config.json sets
`sample_from_anchor`.

- z-lab (`DFlashDraftModel`, `DFlash2DraftModel`): fields in `dflash_config` or at the top level; rows fill in the block
  (row j drafts its own position) unless `sample_from_anchor` says otherwise.
- DeepSpec (`Qwen3DSparkModel`): a copy of the target's config with the fields at the top level,
  `markov_rank` 0 for its DFlash drafters; rows shifted (row j drafts position s+j+1), the
  convention its trainer labels with, for DSpark and DFlash alike.
- SpecForge / RadixArk (`DSparkDraftModel` of model_type qwen3, `dflash_config.projector_type`
  "dspark"): fields nested; rows shifted; heads saved under `logit_head.`, and the aliases
  `context_proj`, `context_norm`, `final_norm` of `fc`, `hidden_norm`, `norm`.
- speculators (`speculators_model_type`): the layers' config in `transformer_layer_config`, the
  context layers in `aux_hidden_state_layer_ids`, a reduced vocabulary in `draft_vocab_size` with
  `d2t`. Its DSpark releases were trained both ways, so a speculators DSpark config must say
  `sample_from_anchor`."""

from collections.abc import Callable
from dataclasses import dataclass

from blockspec.loading.weights import stored_name
from blockspec.sampling import is_int

SHIFTED_FLAG = "sample_from_anchor"  # vLLM's name (other ports': shift_label): true, row j drafts position s+j+1


@dataclass(frozen=True)
class Dialect:
    name: str
    matches: Callable[[dict], bool]  # of config.json
    read: Callable[[dict], dict]  # config.json -> the one form (raises ValueError where ambiguous)
    aliases: tuple[tuple[str, str], ...] = ()  # tensor-name prefixes -> ours

    def rename(self, name: str) -> str | None:
        """A checkpoint tensor's name as our parameter's (None: not loaded)."""
        for prefix, ours in self.aliases:
            if name.startswith(prefix):
                name = ours + name[len(prefix) :]
                break
        return stored_name(name)


def same(raw: dict) -> dict:
    return raw


def architectures(raw: dict) -> list:
    return raw.get("architectures") or []


def read_speculators(raw: dict) -> dict:
    """The layers' config lifted to the top level; its context layers counted as HF's hidden_states
    are (`aux_hidden_state_layer_ids`: the embedding is 0), ours from the first layer's output."""
    kind = raw.get("speculators_model_type")
    architecture = {"dflash": "DFlashDraftModel", "dspark": "Qwen3DSparkModel"}.get(kind)
    if architecture is None:
        raise ValueError(f"speculators_model_type {kind!r} is not a supported drafter (supported: dflash, dspark)")
    layers = raw.get("transformer_layer_config")
    if not isinstance(layers, dict):
        raise ValueError("a speculators config needs its layers' config in transformer_layer_config")  # noqa: TRY004
    if kind == "dspark" and SHIFTED_FLAG not in raw:
        raise ValueError(
            f"a speculators DSpark config leaves its row convention open: set {SHIFTED_FLAG} (true: row j "
            "drafts position s+j+1, as DeepSpec trains; false: position s+j, as z-lab's DFlash and speculators "
            "releases before the flag)"
        )
    aux = raw.get("aux_hidden_state_layer_ids")
    fields = {k: raw[k] for k in SPECULATORS_FIELDS if k in raw}
    # its sliding layers' blocks bidirectional (else causal: the reference's rule with is_causal unset)
    causal = {"is_causal": False} if raw.get("sliding_window_non_causal") else {}
    if aux is not None:
        fields["target_layer_ids"] = [i - 1 for i in aux] if isinstance(aux, list) and all(map(is_int, aux)) else aux
    return {**layers, **causal, "architectures": [architecture], "dflash_config": fields}


SPECULATORS_FIELDS = (
    "block_size",
    "mask_token_id",
    "draft_vocab_size",
    SHIFTED_FLAG,
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
)
SPECFORGE_ALIASES = (
    ("logit_head.markov_head.", "markov_head."),
    ("logit_head.confidence_head.", "confidence_head."),
    ("context_proj.", "fc."),
    ("context_norm.", "hidden_norm."),
    ("final_norm.", "norm."),
)

DIALECTS = (
    Dialect("speculators", lambda raw: "speculators_model_type" in raw, read_speculators),
    Dialect("z-lab", lambda raw: {"DFlashDraftModel", "DFlash2DraftModel"} & set(architectures(raw)), same),
    Dialect(
        "deepspec",
        lambda raw: "Qwen3DSparkModel" in architectures(raw),
        same,
        (("markov_w1.", "markov_head.markov_w1."), ("markov_w2.", "markov_head.markov_w2.")),
    ),
    Dialect(
        "specforge",
        lambda raw: "DSparkDraftModel" in architectures(raw),
        same,
        SPECFORGE_ALIASES,
    ),
)
NO_DIALECT = Dialect("unknown", lambda raw: True, same)  # the registry then names what is supported


def dialect_of(raw: dict) -> Dialect:
    """The dialect config.json is written in (first match)."""
    return next((d for d in DIALECTS if d.matches(raw)), NO_DIALECT)
