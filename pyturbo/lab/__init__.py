"""The lab: where the formats come from and how encoder variants are measured.

- `codebook`: the Lloyd-Max codebooks and rotation signs, and the generator of the C, GLSL and
  CUDA tables that the patch series carries (`python -m pyturbo.lab.codebook --write`);
- `cuda_instances`: the generated CUDA flash-attention template instances;
- `reference`: the NumPy codec, equal to the C one bit for bit;
- `kvlab`: real Q/K/V of a model replayed with encoder variants (`pyturbo kvlab`);
- `trellis`: trellis-coded quantization, a lever measured here and end to end in transformers,
  not a type (`python -m pyturbo.lab.trellis [e2e]`).

Of the lab, only the codebooks are used at run time (by pyturbo.hf's torch codec); the tests and
`pyturbo doctor` hold the C code to the rest.
"""
