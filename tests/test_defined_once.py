"""What every stage shares is defined once: read from the source, the torch calls behind each convention appear only
in the module that defines it.

Saving and restoring the random generators and restoring tensors by value live in ``compfx/state.py``; what a
batch is and which device a model is on live in ``compfx/batches.py``. Any other module that needs them calls
those. The source is read with strings and comments blanked out, so a docstring that shows ``torch.get_rng_state()``
in an example is not a second definition.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The modules that define the conventions below.
HOMES = frozenset({"compfx/state.py", "compfx/batches.py"})

#: What is defined once: a name, the pattern of its torch calls (on code, strings and comments blanked), and what
#: to call instead.
CONVENTIONS: dict[str, tuple[str, str]] = {
    "torch's RNG state read or set": (
        r"\b(get_rng_state|set_rng_state)\b", "compfx.state.RngState, rng_preserved or torch_rng_preserved"),
    "torch's RNG forked": (r"\bfork_rng\b", "compfx.state.torch_rng_preserved or rng_preserved"),
    "a default generator seeded or read": (r"\bdefault_generators?\b", "compfx.state.seed_device or RngState"),
    "a generator's state read or set": (
        r"\.(get_state|set_state)\(|\brandom\.(getstate|setstate)\(",
        "compfx.state.saved_generators / restore_generators, or rng_preserved"),
    "a tensor saved with a copy of its value": (r"\((\w+), \1\.detach\(\)\.clone\(\)\)", "compfx.state.saved_values"),
    "a saved value copied back into a tensor": (
        r"\.copy_\(", "compfx.state.restore_values, buffers_restored or restore_state"),
    "the device of a model": (
        r"next\((iter\()?[\w.]*\.(parameters|buffers)\(\)"  # next(model.parameters()).device
        r"|\.device\b[^\n]*\bfor \w+ in [^\n]*\.(parameters|buffers)\(\)"  # {t.device for t in model.parameters()}
        r"|\bfor \w+ in [^\n]*\.(parameters|buffers)\(\)[^\n]*\bfor \w+ in [^\n]*\.device\b"  # ...(t.device)}
        r"|\bfor \w+ in \(\*[\w.]+\.parameters\(\), \*[\w.]+\.buffers\(\)\):\n\s*return \w+\.device",
        "compfx.batches.model_device or model_devices"),
}

#: (file, convention) -> why that file keeps a call of its own. Each entry must still be needed (a test checks).
ALLOWED: dict[tuple[str, str], str] = {
    ("compfx/search/distributed.py", "a saved value copied back into a tensor"):
        "broadcast_training_state copies the value rank 0 broadcast into a tensor the collective could not write "
        "in place (another device, not contiguous): a broadcast received, not a state restored",
}


def code_only(source: str) -> str:
    """``source`` with every string and comment blanked (spaces; line breaks kept, so line numbers hold)."""
    chars = [list(line) for line in source.splitlines(keepends=True)]
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.STRING, tokenize.COMMENT) or token.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            (row, col), (end_row, end_col) = token.start, token.end
            for r in range(row, end_row + 1):
                line = chars[r - 1]
                for c in range(col if r == row else 0, end_col if r == end_row else len(line)):
                    if line[c] != "\n":
                        line[c] = " "
    return "".join("".join(line) for line in chars)


def found_in(source: str) -> list[tuple[str, int]]:
    """(convention, line) for every call of a convention in ``source``."""
    code = code_only(source)
    return [(name, code.count("\n", 0, match.start()) + 1)
            for name, (pattern, _) in CONVENTIONS.items() for match in re.finditer(pattern, code)]


def _sources() -> dict[str, Path]:
    """compfx's modules and passes/ (installed as compfx.passes), by path from the repository root."""
    found = {}
    for folder in (ROOT / "compfx", ROOT / "passes"):
        for path in sorted(folder.rglob("*.py")):
            if not path.is_relative_to(ROOT / "compfx" / "passes"):  # the link to passes/: read there
                found[path.relative_to(ROOT).as_posix()] = path
    return found


def calls_outside_homes() -> dict[tuple[str, str], list[int]]:
    """(file, convention) -> lines, for every call outside :data:`HOMES`."""
    calls: dict[tuple[str, str], list[int]] = {}
    for name, path in _sources().items():
        if name not in HOMES:
            for convention, line in found_in(path.read_text()):
                calls.setdefault((name, convention), []).append(line)
    return calls


def test_each_convention_is_called_only_where_it_is_defined():
    calls = calls_outside_homes()
    stray = [f"{file}:{lines} {convention} (call {CONVENTIONS[convention][1]})"
             for (file, convention), lines in sorted(calls.items()) if (file, convention) not in ALLOWED]
    assert not stray, "defined again outside compfx/state.py and compfx/batches.py:\n" + "\n".join(stray)


def test_every_allowed_call_is_still_there():
    calls = calls_outside_homes()
    stale = [f"{file}: {convention}" for file, convention in ALLOWED if (file, convention) not in calls]
    assert not stale, "ALLOWED names calls that are gone; drop them from the list: " + "; ".join(stale)


def test_the_homes_define_every_convention():
    defined = {convention for name in HOMES for convention, _ in found_in((ROOT / name).read_text())}
    assert defined == set(CONVENTIONS)


# -- the check itself can fail ---------------------------------------------------------------------------------

@pytest.mark.parametrize("source, convention", [
    ("state = torch.cuda.get_rng_state(0)\n", "torch's RNG state read or set"),
    ("torch.set_rng_state(saved)\n", "torch's RNG state read or set"),
    ("with torch.random.fork_rng(devices=[]):\n    pass\n", "torch's RNG forked"),
    ("torch.random.default_generator.manual_seed(0)\n", "a default generator seeded or read"),
    ("state = loader.generator.get_state()\n", "a generator's state read or set"),
    ("random.setstate(state)\n", "a generator's state read or set"),
    ("saved = [(b, b.detach().clone()) for b in model.buffers()]\n", "a tensor saved with a copy of its value"),
    ("for buffer, value in saved:\n    buffer.copy_(value)\n", "a saved value copied back into a tensor"),
    ("device = next(model.parameters()).device\n", "the device of a model"),
    ("device = next(iter(model.parameters())).device\n", "the device of a model"),
    ("devices = {t.device for t in (*model.parameters(), *model.buffers())}\n", "the device of a model"),
    ("cuda = {i for t in model.parameters() for i in cuda_devices(t.device)}\n", "the device of a model"),
    ("for tensor in (*model.parameters(), *model.buffers()):\n    return tensor.device\n", "the device of a model"),
])
def test_each_convention_is_found(source, convention):
    assert [name for name, _ in found_in(source)] == [convention]


def test_strings_and_comments_are_not_calls():
    source = ('"""\n>>> before = torch.get_rng_state()\n"""\n'
              "x = 1  # torch.random.fork_rng would do it\n"
              "message = f'restore with buffer.copy_(value) and {x}'\n")
    assert found_in(source) == []
    assert found_in(source + "torch.set_rng_state(before)\n") == [("torch's RNG state read or set", 6)]
