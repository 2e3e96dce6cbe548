"""The corpus of the embedded model: standard-library prose kept only when it reads as English, chats rendered by
the project's K3 renderer with exactly the assistant turns as targets, everything reproducible from the seed."""

from __future__ import annotations

import random

import pytest

from rocm_k3.formats.parsers import parse_output
from rocm_k3.tokenizers.byte import embedded_byte_tokenizer
from rocm_k3.formats.k3_chat import K3ChatRenderer
from rocm_k3.training.chats import WEATHER_TOOL, Chat, make_chat, render_training_chat
from rocm_k3.training.corpus import DRILL, PROSE, CorpusConfig, build_corpus
from rocm_k3.training.drills import SEPARATOR, drill_rows
from rocm_k3.training.prose import (
    clean_paragraphs,
    is_clean_paragraph,
    prose_documents,
    stdlib_docstrings,
)

TOKENIZER = embedded_byte_tokenizer()
DOCS = [
    ("mod.f", "Return the number of items in a container.\n\nThe result is always a whole number, and it is "
              "never negative."),
    ("mod.g", "Return f(x) for every x.\n\n>>> g(1)\n2\n\n    indented code = 1\n\nSee os.path for more."),
    ("mod.h", "Open the file and read\nevery line of it into a list of strings.\n\nUse __enter__ for this."),
    ("mod.i", "Return the number of items in a container."),  # a duplicate paragraph: dropped
]


def test_prose_filter_keeps_sentences_and_drops_code() -> None:
    assert is_clean_paragraph("Return the number of items in a container.")
    for text in ("Return f(x) for every x.", "See os.path for more details about paths.",
                 "Use __enter__ for this kind of object.", "Set the value with x = 1 and then return.",
                 "Return the OrderedDict of items in a container.", "short one.",
                 "lowercase start is not a sentence in this corpus.", "Caf\u00e9 names are not ASCII text here."):
        assert not is_clean_paragraph(text), text
    assert clean_paragraphs(DOCS[2][1]) == ["Open the file and read every line of it into a list of strings."]
    docs = prose_documents(DOCS)
    assert [d.source for d in docs] == ["mod.f", "mod.h"]
    assert docs[0].text.count("\n\n") == 1  # one document per docstring, paragraphs kept apart


def test_stdlib_docstrings_come_from_this_interpreter() -> None:
    docs = dict(stdlib_docstrings())
    assert len(docs) > 2000
    assert "builtins.len" in docs and "items" in docs["builtins.len"]
    assert any(source.startswith("pydoc_data.topics.") for source in docs)


def test_chat_targets_are_exactly_the_assistant_turns() -> None:
    renderer = K3ChatRenderer(TOKENIZER)
    chat = Chat("tool", (
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temperature_c": 18}'},
        {"role": "assistant", "content": "It is 18 degrees C.", "reasoning_content": "Answer."},
    ), (WEATHER_TOOL,))
    rendered = render_training_chat(renderer, chat)
    ids, target = rendered.token_ids, rendered.target
    spans, start = [], None
    for i, flag in enumerate([*target, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            spans.append(TOKENIZER.decode(ids[start:i]))
            start = None
    assert spans == [
        'Call the tool.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
        '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris'
        '<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>',
        'Answer.<|close|>think<|sep|><|open|>response<|sep|>It is 18 degrees C.<|close|>response<|sep|>'
        '<|close|>message<|sep|><|end_of_msg|>',
    ]
    # what precedes the first target is the serving prompt; the parser turns the target into the call
    prompt = renderer.render(list(chat.messages[:1]), tools=[WEATHER_TOOL])
    assert ids[:len(prompt.token_ids)] == prompt.token_ids and target.index(True) == len(prompt.token_ids)
    parsed = parse_output("kimi_k3", spans[0], tools=[WEATHER_TOOL], prompt_in_think=prompt.prompt_in_think)
    assert [(c.name, c.arguments_json) for c in parsed.tool_calls] == [("get_weather", '{"city": "Paris"}')]


def test_generated_chats_render_and_parse() -> None:
    """Every drawn chat renders (targets end on <|end_of_msg|>) and each tool turn parses to its call."""
    renderer = K3ChatRenderer(TOKENIZER)
    rng = random.Random(7)
    end = TOKENIZER.special_tokens["<|end_of_msg|>"]
    kinds = set()
    for _ in range(60):
        chat = make_chat(rng, texts=["Return the number of items in a container."])
        kinds.add(chat.kind)
        rendered = render_training_chat(renderer, chat)
        assert rendered.target[-1] and rendered.token_ids[-1] == end
        for k, message in enumerate(chat.messages):
            if message["role"] == "assistant" and message.get("tool_calls"):
                prompt = renderer.render(list(chat.messages[:k]), **chat.render_kwargs())
                full = renderer.render(list(chat.messages[:k + 1]), add_generation_prompt=False,
                                       **chat.render_kwargs())
                text = TOKENIZER.decode(full.token_ids[len(prompt.token_ids):])
                parsed = parse_output("kimi_k3", text, tools=list(chat.tools), thinking=chat.thinking,
                                      prompt_in_think=prompt.prompt_in_think)
                call = message["tool_calls"][0]["function"]
                assert [c.name for c in parsed.tool_calls] == [call["name"]]
    assert kinds == {"arithmetic", "units", "tool", "repeat"}


def test_corpus_is_reproducible_and_split() -> None:
    config = CorpusConfig(seed=3, chats=12, heldout_chats=4, heldout_every=2)
    a = build_corpus(config, TOKENIZER, DOCS)
    b = build_corpus(config, TOKENIZER, DOCS)
    assert a == b
    assert sum(ex.kind != PROSE for ex in a.train) == 12
    assert sum(ex.kind not in (PROSE, DRILL) for ex in a.heldout) == 4
    rows = [TOKENIZER.decode(ex.token_ids) for ex in a.train + a.heldout if ex.kind == PROSE]
    paragraphs = [p for row in rows for p in row.split("\n\n")]  # rows pack documents, blank-line separated
    assert sorted(paragraphs) == sorted(p for d in prose_documents(DOCS) for p in d.text.split("\n\n"))
    assert all(all(ex.target) for ex in a.train if ex.kind == PROSE)
    other = build_corpus(CorpusConfig(seed=4, chats=12, heldout_chats=4, heldout_every=2), TOKENIZER, DOCS)
    assert other.train != a.train
    assert "container" in a.words
    assert len(a.drills) == config.drills and all(ex.kind == DRILL for ex in a.drills)
    assert sum(ex.kind == DRILL for ex in a.heldout) == config.heldout_drills
    assert not any(ex.kind == DRILL for ex in a.train)  # drills train apart (the first steps)
    with pytest.raises(ValueError, match="chats"):
        CorpusConfig(chats=0)
    with pytest.raises(ValueError, match="drill_row_tokens"):
        CorpusConfig(drill_row_tokens=0)


def test_drill_rows_repeat_each_piece_and_target_only_the_copy() -> None:
    words = ["return", "the", "number", "of", "items", "in", "a", "container"]
    rows = drill_rows(random.Random(0), TOKENIZER, words, 40, 128)
    assert drill_rows(random.Random(0), TOKENIZER, words, 40, 128) == rows
    kinds = set()
    for row in rows:
        assert row.kind == DRILL and len(row.token_ids) <= 128
        text = TOKENIZER.decode(list(row.token_ids))
        lines = text.split("\n")
        assert lines[-1] == "" and len(lines) >= 2, text
        copies = []
        for line in lines[:-1]:
            first, second = line.split(SEPARATOR)
            assert first == second and first, line
            copies.append(second + "\n")
            kinds.add("city" if any(c in first for c in ("Paris", ",")) or first[:1].isupper() else
                      "number" if first[:1].isdigit() else "word")
        targets = TOKENIZER.decode([t for t, flag in zip(row.token_ids, row.target) if flag])
        assert targets == "".join(copies)  # the second copy of every piece, nothing else
    assert kinds == {"city", "number", "word"}
