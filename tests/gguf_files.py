"""GGUF files in other formats made from the shipped Q4_1 model: only Q4_1 ships, so Q4_0 and Q8_0
files are made by dequantizing its quantized tensors and quantizing them again with the `gguf`
package's quantizers; metadata and the other tensors are copied as they are."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def requantize_gguf(source: str | Path, target: str | Path, fmt: str) -> Path:
    """Writes `target` (once: an existing file is kept) with `source`'s Q4_1 tensors in `fmt`."""
    import gguf
    from gguf.quants import dequantize, quantize

    target = Path(target)
    if target.is_file():
        return target
    qtype = gguf.GGMLQuantizationType[fmt]
    reader = gguf.GGUFReader(str(source))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_suffix(f".{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(staging), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        data, kind = np.array(t.data), t.tensor_type
        if kind == gguf.GGMLQuantizationType.Q4_1:
            data, kind = quantize(dequantize(data, kind), qtype), qtype
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(staging, target)
    return target
