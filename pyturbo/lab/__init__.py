"""The lab: experiments that choose what the format and the runtime do, measured on real data.

- `kvlab`: real Q/K/V of a model replayed with encoder variants (`pyturbo kvlab`);
- `trellis`: the trellis study: Gaussian MSE against Lloyd-Max and the end-to-end KLD in
  transformers (`python -m pyturbo.lab.trellis [e2e]`).

The format itself (signs, codebooks, the reference codec, the trellis search and the generators
of the shipped tables) is pyturbo.format. Only the tests and the CLI's `kvlab` command import the lab.
"""
