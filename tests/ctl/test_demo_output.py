"""The demo's generation line (kafila_ctl/demo.py `generation_markup`), rendered as `kafila-ctl demo`
prints it. A new user's report (2026-12-01): `demo --synth` printed what looked like raw bytes
(replacement characters and \\x escapes): a random-weight model emits arbitrary bytes. Its line
now shows the token ids; a real model's text is printed as it is."""

from __future__ import annotations

import io

from rich.console import Console

from kafila_ctl.demo import SHOWN_NOISE_IDS, generation_markup, ring_note


def rendered(markup: str) -> str:
    console = Console(file=io.StringIO(), width=400, color_system=None)
    console.print(markup)
    return console.file.getvalue().rstrip("\n")


#: what the synthesised model's byte-level tokenizer decodes 0x76 0xF4 0x19 0x46 0x06 0xE8 to
NOISE = {"text": "v\ufffd\x19F\x06\ufffd", "token_ids": [118, 244, 25, 70, 6, 232]}


def test_a_random_weight_models_line_shows_its_token_ids_not_bytes():
    line = rendered(generation_markup("Once upon a time", NOISE, synth=True))
    assert line == ("Once upon a time -> token ids 118 244 25 70 6 232 (random weights: the text they decode to is "
                    "noise, not shown)")
    assert "\ufffd" not in line and "\\x" not in line and "b'" not in line


def test_a_long_noise_generation_shows_the_first_ids_and_counts_the_rest():
    result = {"text": "", "token_ids": list(range(SHOWN_NOISE_IDS + 24))}
    line = rendered(generation_markup("A", result, synth=True))
    assert " ".join(str(i) for i in range(SHOWN_NOISE_IDS)) + " ... (24 more)" in line


def test_a_real_models_text_is_printed_as_generated():
    result = {"text": ", there was a little girl named [Lily].", "token_ids": [1, 2, 3]}
    assert rendered(generation_markup("Once upon a time", result, synth=False)) == \
        "Once upon a time, there was a little girl named [Lily]."


def test_the_ring_note_says_every_member_holds_blocks_only_when_each_does():
    """Issue 21: `demo --model` said "every member holds blocks" while two members, lost after their
    stages failed, held none (the host had replanned the model onto itself)."""
    ring = {"members": [{"name": "m0", "blocks": [0, 2]}, {"name": "m1", "blocks": [2, 4]},
                        {"name": "m2", "blocks": [4, 6]}]}
    assert ring_note(ring) == "the demo's ring: every member holds blocks"
    lost = {"members": [{"name": "m0", "blocks": [0, 6]},
                        {"name": "m1", "blocks": None, "lost": "it failed to load its stage: no such tensor."},
                        {"name": "m2", "blocks": None, "standby": True}]}
    assert ring_note(lost) == ("holding no blocks: m1 (lost: it failed to load its stage: no such tensor); "
                               "m2 (on standby)")
