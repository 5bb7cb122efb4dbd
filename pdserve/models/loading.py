"""One place that turns the `--model` and `--dtype` settings into a served model.

`--model` is a built-in name (tinygpt, smollm2-135m-instruct), a .gguf file (converted once into a
cached checkpoint directory) or a checkpoint directory. Every service loads the config, tokenizer
and fingerprint; only the services that run the model build it (`weights=True`). The router never
does, and this module imports torch only to build.
"""

import dataclasses
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.core.config import AUTO_WEIGHTS, ModelConfig
from pdserve.kernels import native
from pdserve.kernels import step_ops as fused_ops
from pdserve.models import checkpoint
from pdserve.models.tokenizer import ByteTokenizer, Tokenizer

if TYPE_CHECKING:  # the protocol imports torch, which the router must never load
    from pdserve.models.protocol import CausalLM

TINYGPT = "tinygpt"
HASH_BLOCK = 1 << 20


@dataclass
class ServedModel:
    name: str
    config: ModelConfig
    tokenizer: Tokenizer
    fingerprint: str  # architecture, shapes, dtype and a hash of the weights
    source: Path | None = None  # the checkpoint directory; None for TinyGPT
    model: "CausalLM | None" = None  # the built model where weights were asked for
    gguf: Path | None = None  # the GGUF file the checkpoint was converted from, if any

    @property
    def identity(self) -> str:
        """How errors name this model."""
        c = self.config
        kernel = f" on the {c.q4_kernel} kernel" if c.q4_kernel else ""
        return (
            f"{self.name} ({c.architecture}, {c.dtype}, {c.weights}{kernel}, "
            f"{c.step_ops} step ops, fingerprint {self.fingerprint})"
        )

    @property
    def built(self) -> "CausalLM":
        """The built model, for the services that run it (loaded with weights=True)."""
        if self.model is None:
            raise RuntimeError(f"{self.identity} was loaded without its weights")
        return self.model


def load_served_model(
    ref: str,
    dtype: str = "",
    weights: bool = True,
    weight_format: str = "dense",
    numerics: str = "fast",
    q4_kernel: str = "auto",
    step_ops: str = "auto",
) -> ServedModel:
    """`weight_format` (--weights) is how the linear layers hold their weights; `auto` picks
    q4 for a bfloat16 model from a GGUF, dense for any other. `numerics` (--numerics): fast or
    invariant kernels (pdserve.core.config.NUMERICS). `q4_kernel` (--q4-kernel): what
    multiplies q4 layers (pdserve.kernels.native). `step_ops` (--step-ops): torch's ops or the
    fused native ones for the rest of a step (pdserve.kernels.step_ops); auto picks."""
    served = _describe(ref, dtype, weight_format, numerics, q4_kernel, step_ops)
    if weights:
        from pdserve.models.registry import build

        served.model = build(served.config, served.source, served.gguf)
    return served


def _describe(
    ref: str, dtype: str, weight_format: str, numerics: str, q4_kernel: str, step_ops: str
) -> ServedModel:
    if ref.lower() == TINYGPT:
        dense = weight_format == AUTO_WEIGHTS
        dtype = dtype or "float32"
        config = ModelConfig(
            dtype=dtype,
            weights="dense" if dense else weight_format,
            numerics=numerics,
            step_ops=fused_ops.resolve(step_ops, numerics, dtype),
        )
        return ServedModel(TINYGPT, config, ByteTokenizer(), fingerprint(config, []))
    from pdserve.models import gguf_import  # numpy only: the router may import it

    gguf = _gguf_file(ref)
    directory = _checkpoint_dir(ref, gguf)
    config = checkpoint.model_config(directory, dtype)
    if weight_format == AUTO_WEIGHTS:
        ships_q4 = gguf is not None and gguf_import.holds_q4_1(directory)
        weight_format = "q4" if ships_q4 and config.dtype == "bfloat16" else "dense"
    kernel = native.require(q4_kernel) if weight_format == "q4" else ""
    ops = fused_ops.resolve(step_ops, numerics, config.dtype)
    config = dataclasses.replace(
        config, weights=weight_format, numerics=numerics, q4_kernel=kernel, step_ops=ops
    )
    files = checkpoint.weight_files(directory)
    name = (
        Path(ref).stem if ref.endswith(".gguf") else directory.name if Path(ref).is_dir() else ref
    )
    tokenizer = checkpoint.tokenizer(directory, config)
    return ServedModel(name, config, tokenizer, fingerprint(config, files), directory, gguf=gguf)


def _gguf_file(ref: str) -> Path | None:
    from pdserve.models import gguf_import

    if ref.lower() == gguf_import.SMOLLM2_NAME:
        return gguf_import.smollm2_gguf_path()
    path = Path(ref).expanduser()
    if path.suffix != ".gguf":
        return None
    if not path.is_file():
        raise FileNotFoundError(f"--model {ref}: no such GGUF file")
    return path


def _checkpoint_dir(ref: str, gguf: Path | None) -> Path:
    from pdserve.models import gguf_import

    if gguf is not None:
        return gguf_import.ensure_converted(gguf)
    path = Path(ref).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"--model {ref}: not a checkpoint directory, a .gguf file or a "
            f"built-in name ({TINYGPT}, {gguf_import.SMOLLM2_NAME})"
        )
    return path


def fingerprint(config: ModelConfig, weight_files: list[Path]) -> str:
    """16 hex digits of SHA-256 over the config (shapes, dtype) and the weight files' bytes."""
    digest = hashlib.sha256(json.dumps(asdict(config), sort_keys=True).encode())
    for path in weight_files:
        with open(path, "rb") as f:
            while block := f.read(HASH_BLOCK):
                digest.update(block)
    return digest.hexdigest()[:16]


class ModelMismatch(Exception):
    """A peer or a request names another model than the one this service serves."""


def check_same_model(served: ServedModel, fingerprint: str, what: str) -> None:
    if fingerprint != served.fingerprint:
        raise ModelMismatch(
            f"{what} is for model {fingerprint or '(none named)'}, but this "
            f"instance serves {served.identity}; every service must agree on --dtype, "
            "--weights, --numerics, --q4-kernel and --step-ops (auto ones resolve by CPU)"
        )
