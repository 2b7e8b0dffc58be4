"""Self-instruct chat prompts: questions the model writes itself, filtered, deduplicated, held-out sets kept out."""

import json

from hf_tidar.training import distill as distill_module
from hf_tidar.training.self_instruct import (
    REQUEST,
    SEED_TOPICS,
    extract_question,
    held_out_prompts,
    self_instruct_questions,
)


def test_the_first_well_formed_question_of_a_reply_is_kept():
    assert extract_question('One question might be: "How could the French Revolution have been avoided?"') == \
        "How could the French Revolution have been avoided?"
    assert extract_question("Sure.\n1. How do I keep basil alive indoors? 2. Why?") == "How do I keep basil alive indoors?"
    assert extract_question("I'm ready to help. What's your question?") is None  # about the asking itself
    assert extract_question("Why?") is None  # too short
    assert extract_question("An AI assistant, no doubt about that.") is None  # no question at all
    assert extract_question("how do magnets work?") is None  # not a sentence
    assert extract_question("Question: What's a fun grammar trick?") == "What's a fun grammar trick?"  # no label
    assert extract_question("One question: Can you answer this: How do bees find flowers?") == \
        "How do bees find flowers?"
    assert extract_question("A: What a great topic. How do tides follow the moon?") == "How do tides follow the moon?"
    assert extract_question("I'm ready to assist with questions like this. What do you have?") is None


def test_questions_are_distinct_seeded_and_never_a_held_out_prompt():
    held_out = held_out_prompts()
    assert "Why is the sky blue?" in held_out and any("def " in p or "import" in p for p in held_out)
    asked = []

    def sample(requests):
        asked.extend(requests)
        replies = []
        for i, request in enumerate(requests):
            topic = request.removeprefix(REQUEST.split("{topic}")[0]).split(".")[0]
            replies.append(f"Here is one: How do people usually think about {topic}, number {i % 3}?")
        replies[0] = "Why is the sky BLUE?"  # a held-out prompt, in other case: dropped
        replies[1] = "No question here."
        return replies

    first = self_instruct_questions(sample, 20, seed=3, batch_size=8, exclude=held_out)
    again = self_instruct_questions(sample, 20, seed=3, batch_size=8, exclude=held_out)
    assert first == again and len(first) == 20 == len(set(first))
    assert not any("sky" in q.lower() for q in first)
    assert all(any(topic in q for topic in SEED_TOPICS) for q in first)
    assert all(r.startswith(REQUEST.split("{topic}")[0]) for r in asked)


def test_too_few_usable_replies_gives_what_there_is(caplog):
    questions = self_instruct_questions(lambda requests: ["Nothing to see."] * len(requests), 5, batch_size=4,
                                        max_batches=2)
    assert questions == [] and "0 usable questions of the 5" in caplog.text


def test_distill_asks_once_and_a_resumed_run_reads_the_saved_questions(tmp_path, monkeypatch):
    calls = []

    def fake(sampler, count, seed=0, batch_size=32, exclude=()):
        calls.append(count)
        return [f"What is question number {i} about?" for i in range(count)]

    import hf_tidar.training.self_instruct as module

    monkeypatch.setattr(module, "self_instruct_questions", fake)
    monkeypatch.setattr(module, "sampler_for", lambda model, tokenizer: None)

    class Args:
        output, self_instruct_prompts, seed, batch_size = str(tmp_path / "out"), 3, 0, 4

    class Model:
        def eval(self):
            return self

    class Tokenizer:
        chat_template = "{{ messages }}"

    first = distill_module._self_instruct(Model(), Tokenizer(), Args())
    again = distill_module._self_instruct(Model(), Tokenizer(), Args())
    assert first == again == json.loads((tmp_path / "out" / distill_module.SELF_INSTRUCT_FILE).read_text())
    assert calls == [3]


def test_distill_refuses_self_instruct_for_a_model_without_a_chat_template(tmp_path, capsys):
    from hf_tidar.cli import main
    from hf_tidar.tiny import tiny_byte_level_lm

    model, tokenizer = tiny_byte_level_lm()
    model.save_pretrained(tmp_path / "ar")
    tokenizer.save_pretrained(tmp_path / "ar")
    args = ["distill", "--model", str(tmp_path / "ar"), "--output", str(tmp_path / "out"), "--data", str(tmp_path),
            "--code-prompts", "0", "--chat-prompts", "0", "--self-instruct-prompts", "4", "--held-out-fraction", "0"]
    (tmp_path / "m.py").write_text("def f(x):\n    return x\n" * 10)
    assert main(args) != 0
    assert "needs a model whose tokenizer has a chat template" in capsys.readouterr().err
