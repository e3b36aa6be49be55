"""The format: what a turboq block is, in Python, and the one source of the shipped tables.

- `signs`: the rotation signs (standard library only: ggml_patches/prepare.py loads it by path
  before pyturbo is installed, for a build with other signs);
- `codebook`: the Lloyd-Max codebooks and the turboq8 grid, and the generator of the C and GLSL
  tables that the patch series carries (`python -m pyturbo.format.codebook --write`);
- `trellis`: the trellis types' path search (Viterbi) and codebook training;
- `reference`: the NumPy codec, equal to the C one bit for bit;
- `cuda_instances`: the generator of the CUDA flash-attention instances
  (`python -m pyturbo.format.cuda_instances --write`).

The build, the runtime, pyturbo.hf, the tests and the lab depend on this package; it depends on
nothing of theirs: only on pyturbo.types (the type table) and pyturbo._paths (where the checkout
is), which tests/test_import_layers.py checks.
"""
