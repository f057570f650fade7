"""The run's codecs by name: the dense ones (``engine.compression``) and ``sparse``
(``engine.sparse_codec``, built on them), in one registry neither of them imports."""

from __future__ import annotations

from engine.compression import Codec, FourBitCodec, Fp16Codec, Int8Codec, NoneCodec
from engine.sparse_codec import DEFAULT_BITS, DEFAULT_DENSITY, SparseCodec

_CODECS: dict[str, type[Codec]] = {c.name: c for c in (NoneCodec, Fp16Codec, Int8Codec, FourBitCodec)}
CODEC_NAMES: tuple[str, ...] = (*_CODECS, "sparse")


def get_codec(name: str, density: float | None = None, bits: int | None = None) -> Codec:
    """The codec called ``name`` (``sparse`` at ``density`` with its values in ``bits``, the
    spec's defaults when not given; the others take neither); ``ValueError`` naming the valid
    names otherwise."""
    if name == "sparse":
        return SparseCodec(DEFAULT_DENSITY if density is None else density, bits=bits or DEFAULT_BITS)
    if density is not None or bits is not None:
        raise ValueError(f"codec {name!r} takes no density or bits (only sparse does)")
    try:
        return _CODECS[name]()
    except (KeyError, TypeError):
        raise ValueError(f"unknown codec {name!r}; valid codecs: {', '.join(CODEC_NAMES)}") from None
