"""Memory calculator: how much GPU and CPU memory training a transformer takes, and what each technique saves.

The "Training Transformers Together" demonstration (NeurIPS 2021) shipped such a calculator for BERT, T5, GPT-2,
GPT-3, GPT-J and its collaborative DALL-E, with 8-bit optimizers, optimizer offloading to CPU, gradient
checkpointing and parameter sharing. This module is that calculator as pure functions (no printing), plus LoRA and
any Hugging Face transformers config::

    shape = resolve_model("gpt2-xl")  # a preset, or a path to a config.json (or to its directory)
    result = estimate(shape, MemoryOptions(batch_size=4, seq_len=1024, precision="fp16", optimizer_bits=8))
    result.gpu.total, result.cpu.total  # bytes

Accounting, per parameter (Rajbhandari et al. 2020, "ZeRO", Section 3.1; Dettmers et al. 2021 for 8 bits):

- weights: 4 bytes in fp32, 2 bytes in fp16/bf16 (the working copy the forward pass reads);
- master weights: 4 bytes per *trainable* parameter for the fp32 copy the optimizer updates, kept in mixed precision
  (fp16/bf16) or when the optimizer is offloaded (it updates a CPU copy); none for plain fp32 training on the device;
- gradients: one per trainable parameter, in the working precision (4 or 2 bytes);
- optimizer states: Adam/LAMB keep two states per trainable parameter, 8 bytes in 32 bits, 2 bytes in 8 bits
  (blockwise quantization; the per-block statistics are negligible);
- activations: see `activation_bytes`.

Offloading moves the optimizer states and the fp32 master weights to CPU memory; gradients stay on the device (they
are sent to the CPU one tensor at a time). The total assumes gradients persist between steps, as they do when
accumulating gradients (which a hivemind peer does until the swarm reaches its target batch size).
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

__all__ = [
    "COMPONENTS",
    "COMPONENT_LABELS",
    "GiB",
    "OPTIMIZER_BITS",
    "PRECISIONS",
    "PRESETS",
    "MemoryBreakdown",
    "MemoryEstimate",
    "MemoryOptions",
    "ModelShape",
    "activation_bytes",
    "count_parameters",
    "estimate",
    "head_activation_bytes",
    "resolve_model",
    "shape_from_config",
    "shape_from_preset",
]

GiB = 2**30
PRECISIONS = ("fp32", "fp16", "bf16")
OPTIMIZER_BITS = (32, 8)
COMPONENTS = ("weights", "master_weights", "gradients", "optimizer_states", "activations")
COMPONENT_LABELS = {
    "weights": "weights",
    "master_weights": "fp32 master weights",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "activations": "activations",
}  # how the command line and the web page name the components

_MASTER_BYTES = 4  # an fp32 copy of a trainable parameter
_OPTIMIZER_STATE_BYTES = {32: 8, 8: 2}  # Adam/LAMB: exp_avg and exp_avg_sq, 4 or 1 byte each
_LOSS_BYTES = 4  # the cross-entropy runs in fp32 whatever the precision
_MASK_BYTES = 1  # dropout masks are bool tensors


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class MemoryOptions:
    """How the model is trained.

    batch_size, seq_len: sequences per forward pass and tokens per sequence.
    precision: "fp32", or mixed precision "fp16"/"bf16" (16-bit weights, gradients and activations; fp32 master
        weights).
    optimizer_bits: 32 for a usual Adam/LAMB, 8 for a bitsandbytes 8-bit optimizer.
    offload_optimizer: keep the optimizer states and the fp32 master weights in CPU memory (hivemind's
        `offload_optimizer=True`).
    gradient_checkpointing: keep only each layer's input during the forward pass and recompute the rest.
    parameter_sharing: ALBERT-style, all layers share one set of weights (fewer parameters, as many activations).
    lora_rank: train only LoRA adapters of this rank on the query and value projections; the base weights are frozen
        and need neither gradients nor optimizer states.
    """

    batch_size: int = 1
    seq_len: int = 512
    precision: str = "fp32"
    optimizer_bits: int = 32
    offload_optimizer: bool = False
    gradient_checkpointing: bool = False
    parameter_sharing: bool = False
    lora_rank: int | None = None

    def __post_init__(self) -> None:
        _check_positive_int("batch_size", self.batch_size)
        _check_positive_int("seq_len", self.seq_len)
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if isinstance(self.optimizer_bits, bool) or self.optimizer_bits not in OPTIMIZER_BITS:
            raise ValueError(f"optimizer_bits must be 32 or 8, got {self.optimizer_bits!r}")
        for name in ("offload_optimizer", "gradient_checkpointing", "parameter_sharing"):
            _check_bool(name, getattr(self, name))
        if self.lora_rank is not None:
            _check_positive_int("lora_rank", self.lora_rank)

    @property
    def bytes_per_value(self) -> int:
        """Bytes of one weight, gradient or activation element in the working precision."""
        return 4 if self.precision == "fp32" else 2


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What the calculator needs to know about a model.

    n_params: unique parameters (tied weights counted once). layer_params: how many of them sit in the repeated
    transformer blocks, the part that parameter sharing divides by n_layer; by default all but a vocab x hidden
    embedding. intermediate: width of the feed-forward hidden layer (usually 4 * hidden).
    """

    name: str
    n_params: int
    n_layer: int
    hidden: int
    n_head: int
    vocab: int
    intermediate: int
    layer_params: int | None = None

    def __post_init__(self) -> None:
        for name in ("n_params", "n_layer", "hidden", "n_head", "vocab", "intermediate"):
            _check_positive_int(name, getattr(self, name))
        layers = max(0, self.n_params - self.vocab * self.hidden) if self.layer_params is None else self.layer_params
        if isinstance(layers, bool) or not isinstance(layers, int) or not 0 <= layers <= self.n_params:
            raise ValueError(f"layer_params must be between 0 and n_params={self.n_params}, got {layers!r}")
        object.__setattr__(self, "layer_params", layers)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes by component on one kind of memory (GPU or CPU)."""

    weights: int = 0
    master_weights: int = 0
    gradients: int = 0
    optimizer_states: int = 0
    activations: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, name) for name in COMPONENTS)

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class MemoryEstimate:
    """The calculator's answer: parameters and bytes on the GPU (the training device) and in CPU memory."""

    model: ModelShape
    options: MemoryOptions
    params: int  # parameters stored: unique model weights (after sharing) plus LoRA adapters
    trainable_params: int
    gpu: MemoryBreakdown
    cpu: MemoryBreakdown

    @property
    def total(self) -> int:
        return self.gpu.total + self.cpu.total

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; memory in bytes."""
        return {
            "model": asdict(self.model),
            "options": asdict(self.options),
            "params": self.params,
            "trainable_params": self.trainable_params,
            "gpu": self.gpu.to_dict(),
            "cpu": self.cpu.to_dict(),
            "total": self.total,
        }


# --- the estimate -------------------------------------------------------------------------------------------------


def estimate(shape: ModelShape, options: MemoryOptions) -> MemoryEstimate:
    """Peak memory of a training step by component, on the GPU and in CPU memory (see the module docstring)."""
    base = _stored_params(shape, options)
    adapters = _lora_params(shape, options)
    trainable = adapters if options.lora_rank is not None else base
    width = options.bytes_per_value
    needs_master = options.precision != "fp32" or options.offload_optimizer
    optimizer = MemoryBreakdown(
        master_weights=trainable * _MASTER_BYTES if needs_master else 0,
        optimizer_states=_optimizer_state_bytes(shape, options, trainable),
    )
    device = MemoryBreakdown(
        weights=(base + adapters) * width,
        gradients=trainable * width,
        activations=activation_bytes(shape, options),
    )
    if options.offload_optimizer:
        gpu, cpu = device, optimizer
    else:
        gpu, cpu = _merge(device, optimizer), MemoryBreakdown()
    return MemoryEstimate(shape, options, base + adapters, trainable, gpu, cpu)


def _optimizer_state_bytes(shape: ModelShape, options: MemoryOptions, trainable: int) -> int:
    """Adam/LAMB statistics. With an 8-bit optimizer, trahiv keeps the embeddings' statistics in 32 bits (as the
    bitsandbytes authors recommend for stability), so they cost 8 bytes per parameter whatever optimizer_bits is;
    LoRA freezes the embeddings, which then have no statistics at all."""
    if options.optimizer_bits == 32 or options.lora_rank is not None:
        return trainable * _OPTIMIZER_STATE_BYTES[options.optimizer_bits]
    embeddings = shape.n_params - (shape.layer_params or 0)
    return (trainable - embeddings) * _OPTIMIZER_STATE_BYTES[8] + embeddings * _OPTIMIZER_STATE_BYTES[32]


def _merge(a: MemoryBreakdown, b: MemoryBreakdown) -> MemoryBreakdown:
    return MemoryBreakdown(**{name: getattr(a, name) + getattr(b, name) for name in COMPONENTS})


def _stored_params(shape: ModelShape, options: MemoryOptions) -> int:
    """Unique model parameters. With ALBERT-style sharing, the n_layer blocks keep one block's worth of weights:
    n_params - layer_params + layer_params / n_layer (embeddings are not shared)."""
    layers = shape.layer_params
    assert layers is not None  # ModelShape.__post_init__ fills it in
    if not options.parameter_sharing:
        return shape.n_params
    return shape.n_params - layers + layers // shape.n_layer


def _lora_params(shape: ModelShape, options: MemoryOptions) -> int:
    """LoRA adapters on the query and value projections (hidden -> hidden): A (r x hidden) and B (hidden x r) each,
    so 2 * 2 * r * hidden per layer; one layer's worth when the layers share weights."""
    if options.lora_rank is None:
        return 0
    layers = 1 if options.parameter_sharing else shape.n_layer
    return layers * 2 * 2 * options.lora_rank * shape.hidden


def activation_bytes(shape: ModelShape, options: MemoryOptions) -> int:
    """Activations saved for the backward pass, at their peak (the start of the backward pass).

    Per layer, following Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
    Section 4.1) with s = seq_len, b = batch_size, h = hidden, a = n_head, i = intermediate and w = bytes per value:
    the attention block saves its input, Q, K, V and the output projection's input (5 sbh values), the MLP its
    input, the activation's input and output (sbh + 2 sbi values), the two layer norms their inputs (2 sbh values);
    the attention saves the softmax output and the dropped-out probabilities (2 as^2b values); dropout masks take a
    byte per element (2 sbh + as^2b bytes). Total: sbh (8w + 2) + 2 sbi w + as^2b (2w + 1), which for 16-bit values
    and i = 4h is the paper's sbh (34 + 5 as/h).

    With gradient checkpointing, each layer keeps only its input (sbh w) and one layer's activations exist at a time
    while it is recomputed. Parameter sharing and LoRA do not change activations. `head_activation_bytes` adds the
    output layer and the loss.
    """
    s, b, h, i, w = options.seq_len, options.batch_size, shape.hidden, shape.intermediate, options.bytes_per_value
    per_layer = s * b * h * (8 * w + 2 * _MASK_BYTES) + 2 * s * b * i * w + shape.n_head * s * s * b * (2 * w + 1)
    if options.gradient_checkpointing:
        layers = shape.n_layer * s * b * h * w + per_layer
    else:
        layers = shape.n_layer * per_layer
    return layers + head_activation_bytes(shape, options)


def head_activation_bytes(shape: ModelShape, options: MemoryOptions) -> int:
    """The final layer norm's and the output projection's inputs (2 sbh w), and the cross-entropy over the vocabulary
    in fp32: the saved log-probabilities plus, at the start of the backward pass, their gradient and the logits'
    gradient (3 x 4 sbv bytes; Korthikanti et al. count the first, 4 sbv, which is not the peak)."""
    s, b = options.seq_len, options.batch_size
    return 2 * s * b * shape.hidden * options.bytes_per_value + 3 * _LOSS_BYTES * s * b * shape.vocab


# --- presets ------------------------------------------------------------------------------------------------------


def _preset(name: str, layers: int, other: int, n_layer: int, hidden: int, n_head: int, **sizes: int) -> ModelShape:
    """A preset from its parameters inside the repeated blocks (layers) and outside them (other)."""
    return ModelShape(
        name=name, n_params=layers + other, n_layer=n_layer, hidden=hidden, n_head=n_head, layer_params=layers, **sizes
    )


def _gpt(name: str, n_layer: int, hidden: int, n_head: int, *, positions: int, vocab: int = 50257) -> ModelShape:
    """GPT-2/GPT-3 (and BERT's encoder blocks): a block has 4h^2 + 4h attention, 8h^2 + 5h MLP and 4h layer-norm
    parameters; learned token and position embeddings, a final layer norm, an output layer tied to the embedding."""
    layers = n_layer * (12 * hidden**2 + 13 * hidden)
    other = (vocab + positions) * hidden + 2 * hidden
    return _preset(name, layers, other, n_layer, hidden, n_head, vocab=vocab, intermediate=4 * hidden)


def _gpt3(size: str, n_layer: int, hidden: int, n_head: int) -> ModelShape:
    """GPT-3 (Brown et al. 2020, Table 2.1): GPT-2 blocks, 2048 positions."""
    return _gpt(f"gpt3-{size}", n_layer, hidden, n_head, positions=2048)


def _bert(name: str, n_layer: int, hidden: int, n_head: int) -> ModelShape:
    """BERT (BertModel): GPT-2's blocks; word, position (512) and token-type (2) embeddings with a layer norm; a
    pooler (h^2 + h)."""
    shape = _gpt(name, n_layer, hidden, n_head, positions=512 + 2, vocab=30522)
    return replace(shape, n_params=shape.n_params + hidden**2 + hidden)


def _t5(name: str, n_layer: int, hidden: int, n_head: int, head_dim: int, intermediate: int) -> ModelShape:
    """T5 (v1.0, no biases): encoder blocks have self-attention (4 h a d) and an MLP (2 h i); decoder blocks add
    cross-attention; RMS norms (h each); a shared embedding tied to the output layer; relative position biases.
    n_layer counts encoder and decoder blocks."""
    attention, mlp, vocab = 4 * hidden * n_head * head_dim, 2 * hidden * intermediate, 32128
    layers = n_layer * (attention + mlp + 2 * hidden) + n_layer * (2 * attention + mlp + 3 * hidden)
    other = vocab * hidden + 2 * hidden + 2 * 32 * n_head
    return _preset(name, layers, other, 2 * n_layer, hidden, n_head, vocab=vocab, intermediate=intermediate)


def _gptj() -> ModelShape:
    """GPT-J 6B: 28 parallel blocks (4h^2 attention without biases, 2hi + i + h MLP, one layer norm), rotary
    positions, an untied output layer with a bias."""
    hidden, intermediate, vocab, n_layer = 4096, 16384, 50400, 28
    layers = n_layer * (4 * hidden**2 + 2 * hidden * intermediate + intermediate + 3 * hidden)
    other = 2 * vocab * hidden + vocab + 2 * hidden
    return _preset("gpt-j-6b", layers, other, n_layer, hidden, 16, vocab=vocab, intermediate=intermediate)


def _dalle() -> ModelShape:
    """The collaborative DALL-E of "Training Transformers Together" (dalle-pytorch): 64 decoder blocks with 1024
    hidden units and 16 heads of 64; GEGLU MLPs (h x 8h and 4h x h: 12h^2 + 9h), attention (4h^2 + h) and two layer
    norms (4h); rotary positions; 32,100 T5 text tokens + 256 padding tokens + 8,192 VQGAN image tokens with tied
    input and output embeddings. About 1.1B parameters; sequences of 256 text + 32 x 32 image tokens. The real run
    shared weights between groups of layers (about 8x fewer parameters); `parameter_sharing` shares all layers. The
    activations assume dense attention without reversible layers; the run's sparse (row, column, convolutional)
    attention masks and reversible layers needed much less."""
    hidden, n_layer, vocab = 1024, 64, 32100 + 256 + 8192
    layers = n_layer * (16 * hidden**2 + 14 * hidden)
    other = vocab * hidden + vocab + 2 * hidden
    return _preset("dalle", layers, other, n_layer, hidden, 16, vocab=vocab, intermediate=4 * hidden)


PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        _bert("bert-base", 12, 768, 12),
        _bert("bert-large", 24, 1024, 16),
        _t5("t5-3b", 24, 1024, 32, 128, 16384),
        _t5("t5-11b", 24, 1024, 128, 128, 65536),
        _gpt("gpt2-small", 12, 768, 12, positions=1024),
        _gpt("gpt2-medium", 24, 1024, 16, positions=1024),
        _gpt("gpt2-large", 36, 1280, 20, positions=1024),
        _gpt("gpt2-xl", 48, 1600, 25, positions=1024),
        _gpt3("125m", 12, 768, 12),
        _gpt3("350m", 24, 1024, 16),
        _gpt3("760m", 24, 1536, 16),
        _gpt3("1.3b", 24, 2048, 24),
        _gpt3("2.7b", 32, 2560, 32),
        _gpt3("6.7b", 32, 4096, 32),
        _gpt3("13b", 40, 5140, 40),
        _gpt3("175b", 96, 12288, 96),
        _gptj(),
        _dalle(),
    )
}
_ALIASES = {"gpt2": "gpt2-small", "gpt2-s": "gpt2-small", "gpt2-m": "gpt2-medium", "gpt2-l": "gpt2-large",
            "gpt-j": "gpt-j-6b", "bert": "bert-base"}  # fmt: skip


def _normalize(name: str) -> str:
    return re.sub(r"[\s_-]", "", name.lower())


_LOOKUP = {_normalize(key): target for key, target in [*((n, n) for n in PRESETS), *_ALIASES.items()]}


def shape_from_preset(name: str) -> ModelShape:
    """A preset by name (case, dashes, underscores and spaces ignored); ValueError with close matches otherwise."""
    key = _normalize(name)
    if key in _LOOKUP:
        return PRESETS[_LOOKUP[key]]
    close = difflib.get_close_matches(key, list(_LOOKUP), n=3, cutoff=0.5)
    suggestions = list(dict.fromkeys(_LOOKUP[match] for match in close))
    hint = f" Did you mean {' or '.join(suggestions)}?" if suggestions else ""
    raise ValueError(f"unknown model {name!r}: neither a preset nor a config path.{hint} Presets: {', '.join(PRESETS)}")


def resolve_model(model: str | os.PathLike[str]) -> ModelShape:
    """A ModelShape from a preset name, a config.json path, or a directory holding a config.json."""
    path = Path(model)
    if path.exists() or path.suffix == ".json" or os.sep in str(model):
        return shape_from_config(path)
    return shape_from_preset(str(model))


# --- transformers configs -----------------------------------------------------------------------------------------

_LAYER_INDEX = re.compile(r"(^|\.)\d+(\.|$)")


def shape_from_config(path: str | os.PathLike[str]) -> ModelShape:
    """A ModelShape from a transformers config.json (or a directory with one). The parameter counts are exact: the
    model (causal LM, else seq2seq LM, else the bare model) is built on the meta device, which allocates nothing."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"no config.json at {path}")
    config = _load_config(file)
    n_params, layer_params = count_parameters(_meta_model(config))
    text = config.get_text_config()
    try:
        sizes = {"hidden": text.hidden_size, "n_head": text.num_attention_heads, "vocab": text.vocab_size}
    except AttributeError as e:
        raise ValueError(f"{file} does not describe a transformer the calculator knows: {e}") from e
    return ModelShape(
        name=str(file),
        n_params=n_params,
        n_layer=_n_layer(text),
        layer_params=layer_params,
        intermediate=_intermediate(text, sizes["hidden"]),
        **sizes,
    )


def _load_config(file: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(file))
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"cannot read the transformers config {file}: {e}") from e


def _meta_model(config: Any) -> Any:
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    errors = []
    for auto_class in (AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModel):
        try:
            with torch.device("meta"):
                return auto_class.from_config(config)
        except ValueError as e:  # this config has no model of that kind
            errors.append(str(e))
    raise ValueError(f"transformers cannot build a model from this config: {errors[-1]}")


def count_parameters(model: Any) -> tuple[int, int]:
    """(unique parameters, those inside repeated blocks). Tied weights are one tensor, counted once; a parameter is in
    a repeated block when its name has a ModuleList index (`transformer.h.3.attn.c_attn.weight`)."""
    named = list(model.named_parameters())  # each Parameter once, however many modules it is tied to
    total = sum(p.numel() for _, p in named)
    layers = sum(p.numel() for name, p in named if _LAYER_INDEX.search(name))
    return total, layers


def _n_layer(config: Any) -> int:
    """Blocks in the model: encoder + decoder blocks for encoder-decoder configs."""
    if getattr(config, "is_encoder_decoder", False):
        encoder = getattr(config, "encoder_layers", None) or getattr(config, "num_layers", None)
        decoder = getattr(config, "decoder_layers", None) or getattr(config, "num_decoder_layers", None)
        if encoder and decoder:
            return int(encoder) + int(decoder)
    return int(config.num_hidden_layers)


def _intermediate(config: Any, hidden: int) -> int:
    for name in ("intermediate_size", "n_inner", "d_ff", "ffn_dim", "encoder_ffn_dim"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    return 4 * hidden
