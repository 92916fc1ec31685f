"""Memory estimates that come from the model, not from ``file size x 1.5``.

Admission has to happen *before* loading (reserve, then load), so the first estimate
is read from the GGUF header alone: every tensor's byte size and where llama.cpp will
place it, and the KV cache that the requested context implies from the architecture
numbers. After loading, :class:`DeviceMeter` measures what the device really gave up
so the reservation can be corrected (:meth:`kvrt.accounting.ledger.VramLedger.resize`).

lmxd's hand-written ``model_vram`` table is still accepted (:func:`parse_vram_table`):
an operator's number, where one is given, overrides the derived one.
"""

from __future__ import annotations

import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kvrt.engine.geometry import ModelGeometry
from kvrt.errors import InvalidArgument, KvrtError
from kvrt.system.gpu import llama_gpu_devices

_LAYER = re.compile(r"^blk\.(\d+)\.")
# Tensors llama.cpp always keeps in host memory, whatever n_gpu_layers says.
_HOST_ONLY = {"token_embd.weight"}


class EstimateError(KvrtError):
    """A model file or a VRAM table could not be read into an estimate."""


def parse_vram_table(text: str, *, source: str = "<table>") -> dict[str, int]:
    """lmxd's ``model_vram`` table: one ``<model_key> <bytes>`` entry per line.

    Blank lines and ``#`` comments are skipped. Keys are model paths (or names); a key
    given twice, a missing or non-integer byte count, or extra fields are refused with
    the line number, because a silently misread budget is worse than none.
    """
    table: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2:
            raise EstimateError(f"{source}:{number}: expected '<model_key> <bytes>', got {len(fields)} fields: {raw!r}")
        key, value = fields
        if not value.isdigit():
            raise EstimateError(f"{source}:{number}: byte count {value!r} for {key!r} is not a non-negative integer")
        if key in table:
            raise EstimateError(f"{source}:{number}: {key!r} is listed twice")
        nbytes = int(value)
        if nbytes >= 2**64:
            raise EstimateError(f"{source}:{number}: byte count {nbytes} for {key!r} exceeds 64 bits")
        table[key] = nbytes
    return table


def load_vram_table(path: str | os.PathLike[str]) -> dict[str, int]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EstimateError(f"cannot read VRAM table {path}: {exc}") from exc
    return parse_vram_table(text, source=str(path))


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _check_regular(path: Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), f"mode {stat.S_IFMT(mode):o}")
        raise EstimateError(f"{path} is not a regular file ({kind}); a model must be a GGUF file")


def _open_regular(path: Path) -> BinaryIO:
    """``path`` opened for reading, refused unless it is a regular file.

    Checked before opening (opening a FIFO blocks until a writer appears, and would stall
    the scheduler's one thread) and again on the open descriptor, which is opened
    non-blocking so a file swapped for a FIFO in between cannot block either.
    """
    try:
        _check_regular(path, os.stat(path).st_mode)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise EstimateError(f"cannot read GGUF header of {path}: {exc}") from exc
    try:
        _check_regular(path, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def _read_gguf_header(path: Path) -> tuple[dict[str, object], dict[str, int], list[tuple[str, int]]]:
    """Scalar metadata, array lengths and (tensor name, bytes) of a GGUF file, from its header alone.

    Written here rather than using ``gguf.GGUFReader`` because that one materialises every
    vocabulary string as a NumPy array (about 9 s for a 152k-token vocabulary on the
    development machine); admission runs before every first load and must be cheap.
    """
    import gguf

    fh = _open_regular(path)

    def unpack(fmt: str) -> Any:
        size = struct.calcsize(fmt)
        data = fh.read(size)
        if len(data) != size:
            raise EstimateError(f"{path.name}: GGUF header is truncated at byte {fh.tell()}")
        return struct.unpack(fmt, data)[0]

    def string() -> str:
        n = unpack("<Q")
        if n > 1 << 24:
            raise EstimateError(f"{path.name}: implausible GGUF string length {n} at byte {fh.tell()}")
        return fh.read(n).decode("utf-8", "replace")

    def skip(kind: int) -> None:
        if kind == _STRING:
            fh.seek(unpack("<Q"), os.SEEK_CUR)
        elif kind in _SCALARS:
            fh.seek(struct.calcsize(_SCALARS[kind]), os.SEEK_CUR)
        else:
            raise EstimateError(f"{path.name}: unknown GGUF value type {kind} inside an array")

    with fh:
        if fh.read(4) != b"GGUF":
            raise EstimateError(f"{path.name} is not a GGUF file")
        version, n_tensors, n_kv = unpack("<I"), unpack("<Q"), unpack("<Q")
        if version < 2:
            raise EstimateError(f"{path.name}: GGUF version {version} is not supported (2 or later)")
        fields: dict[str, object] = {}
        arrays: dict[str, int] = {}
        for _ in range(n_kv):
            key, kind = string(), unpack("<I")
            if kind == _STRING:
                fields[key] = string()
            elif kind == _ARRAY:
                item, count = unpack("<I"), unpack("<Q")
                arrays[key] = count
                if item in _SCALARS and item != _STRING:
                    fh.seek(count * struct.calcsize(_SCALARS[item]), os.SEEK_CUR)
                else:
                    for _ in range(count):
                        skip(item)
            elif kind in _SCALARS:
                fields[key] = unpack(_SCALARS[kind])
            else:
                raise EstimateError(f"{path.name}: unknown GGUF value type {kind} for {key!r}")
        tensors = []
        for _ in range(n_tensors):
            name = string()
            dims = [unpack("<Q") for _ in range(unpack("<I"))]
            kind = unpack("<I")
            unpack("<Q")  # data offset
            try:
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise EstimateError(f"{path.name}: tensor {name!r} has unknown ggml type {kind}") from None
            elements = 1
            for d in dims:
                elements *= d
            tensors.append((name, elements // block * type_size))
    return fields, arrays, tensors


@dataclass(frozen=True, kw_only=True)
class ModelShape(ModelGeometry):
    """What a GGUF header says about memory: the model's geometry and its tensor bytes per layer."""

    path: Path
    arch: str
    layer_bytes: tuple[int, ...]
    host_only_bytes: int
    other_bytes: int

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> ModelShape:
        """Parse the header only; tensor data is never touched."""
        path = Path(path).resolve()
        fields, arrays, tensors = _read_gguf_header(path)

        def field(key: str, default: int | None = None) -> int:
            value = fields.get(key)
            if value is None:
                if default is None:
                    raise EstimateError(f"{path.name}: GGUF metadata has no {key!r}")
                return default
            if isinstance(value, bool) or not isinstance(value, int):
                raise EstimateError(f"{path.name}: GGUF metadata {key!r} is {value!r}, not an integer")
            return value

        arch = str(fields.get("general.architecture", ""))
        n_layer = field(f"{arch}.block_count")
        n_embd = field(f"{arch}.embedding_length")
        n_head = field(f"{arch}.attention.head_count")
        n_head_kv = field(f"{arch}.attention.head_count_kv", n_head)
        layer_bytes = [0] * n_layer
        host_only = other = 0
        for name, nbytes in tensors:
            match = _LAYER.match(name)
            if match and int(match.group(1)) < n_layer:
                layer_bytes[int(match.group(1))] += nbytes
            elif name in _HOST_ONLY:
                host_only += nbytes
            else:
                other += nbytes
        try:
            return cls(
                path=path, arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                key_length=field(f"{arch}.attention.key_length", 0),
                value_length=field(f"{arch}.attention.value_length", 0),
                n_vocab=arrays.get("tokenizer.ggml.tokens", 0),
                layer_bytes=tuple(layer_bytes), host_only_bytes=host_only, other_bytes=other,
            )
        except InvalidArgument as exc:
            raise EstimateError(f"{path.name}: GGUF metadata: {exc}") from None

    @property
    def file_weight_bytes(self) -> int:
        return sum(self.layer_bytes) + self.host_only_bytes + self.other_bytes

    def weight_bytes(self, n_gpu_layers: int = -1, *, on_gpu: bool = True) -> int:
        """Weight bytes the budgeted device will hold.

        On a GPU, llama.cpp offloads the *last* ``n_gpu_layers`` blocks and, once every
        block is offloaded, the output head too; the input embedding stays in host
        memory. Without a GPU the budget stands for the process's own memory, so all
        weights count.
        """
        if not on_gpu:
            return self.file_weight_bytes
        n = self.n_layer + 1 if n_gpu_layers < 0 else min(n_gpu_layers, self.n_layer + 1)
        blocks = sum(self.layer_bytes[self.n_layer - min(n, self.n_layer):])
        return blocks + (self.other_bytes if n > self.n_layer else 0)

    def kv_bytes(self, n_ctx: int) -> int:
        return self.kv_bytes_per_token() * n_ctx

    def compute_bytes(self, n_ubatch: int) -> int:
        """llama.cpp's compute buffer, approximately: the logits of a micro-batch plus its
        activations. An estimate on purpose; the measurement after creating the context
        replaces it where a device can be measured."""
        return 4 * n_ubatch * (self.n_vocab + 8 * self.n_embd)


@dataclass(frozen=True)
class Estimate:
    """Bytes one admission asks for, by part, and where the number came from."""

    weights_bytes: int
    kv_bytes: int
    compute_bytes: int
    source: str  # "derived" (from the GGUF header), "table" (operator's number) or "measured"

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes


def context_estimate(shape: ModelShape, n_ctx: int, n_ubatch: int = 512) -> Estimate:
    """What one context of ``n_ctx`` cells (one sequence) adds on top of the weights."""
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx <= 0:
        raise EstimateError(f"n_ctx must be a positive integer, got {n_ctx!r}")
    return Estimate(0, shape.kv_bytes(n_ctx), shape.compute_bytes(min(n_ubatch, n_ctx)), "derived")


class DeviceMeter:
    """Free memory of the GPU devices llama.cpp uses, read before and after a step.

    ``delta()`` is what the step took, or ``None`` where llama.cpp has no GPU device
    (then nothing can be measured and the derived estimate stands). The reading is
    device-wide: another process allocating meanwhile would be counted too, which the
    ledger's reconciliation then shows as drift; ``measure=False`` reads nothing and
    measures nothing (the caller's choice to keep its estimates).
    """

    def __init__(self, measure: bool = True) -> None:
        self._before = self._free() if measure else None

    @staticmethod
    def gpu_present() -> bool:
        return bool(llama_gpu_devices())

    @staticmethod
    def _free() -> list[int] | None:
        """Each GPU's free bytes, in llama.cpp's GPU order (what ``main_gpu`` and ``tensor_split`` count)."""
        devices = llama_gpu_devices()
        return [d.free_bytes for d in devices] if devices else None

    def delta(self) -> int | None:
        if self._before is None:
            return None
        after = self._free()
        if after is None:
            return None
        return max(sum(self._before) - sum(after), 0)

    def delta_by_device(self) -> dict[int, int] | None:
        """What the step took of each GPU (by llama.cpp's GPU index), or ``None`` as for :meth:`delta`."""
        if self._before is None:
            return None
        after = self._free()
        if after is None or len(after) != len(self._before):
            return None
        return {index: max(before - now, 0) for index, (before, now) in enumerate(zip(self._before, after))}
