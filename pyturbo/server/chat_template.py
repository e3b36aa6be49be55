"""The chat template fallback for GGUFs that carry none.

Without a template in the GGUF, llama-server falls back to chatml and llama-cpp-python to
llama-2; a Gemma model then sees turn markers it was never trained on (on the bundled Gemma 3
270M, chatml made it print `<im_start>` junk). A model family whose turn format is known gets it
from templates/<family>.jinja instead, in both engines, and the log says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "templates"
# general.architecture -> template file: the families whose turn format we ship
FAMILY_TEMPLATES = {"gemma": "gemma.jinja", "gemma2": "gemma.jinja", "gemma3": "gemma.jinja"}
END_OF_TURN = {"gemma.jinja": "<end_of_turn>"}


@dataclass(frozen=True)
class Fallback:
    arch: str
    path: Path

    @property
    def end_of_turn(self) -> str:
        return END_OF_TURN[self.path.name]

    def describe(self) -> str:
        return (f"the GGUF has no chat template; using pyturbo's {self.path.name} (the {self.arch} turn format) "
                f"for chat requests")


def gguf_metadata(model: str | Path) -> dict[str, str | None]:
    from pyturbo.gguf_meta import read_metadata

    try:
        meta = read_metadata(model)
    except (ValueError, OSError) as e:
        raise ValueError(f"{model}: not a readable GGUF file ({e})") from None
    return {"arch": meta.get("general.architecture"), "chat_template": meta.get("tokenizer.chat_template")}


def fallback_for(model: str | Path) -> Fallback | None:
    """The fallback template when the GGUF has no chat template and its family has one here."""
    meta = gguf_metadata(model)
    if meta["chat_template"]:
        return None
    name = FAMILY_TEMPLATES.get(meta["arch"] or "")
    return Fallback(meta["arch"], TEMPLATES / name) if name else None
