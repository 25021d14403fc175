"""A tiny chat tokenizer built in the tests (test helper only): byte-level BPE trained on a few
synthetic agent logs, saved as a transformers tokenizer directory with a Jinja chat template
(role markers, a generation prompt, tool calls), so ``--tokenizer DIR`` runs with no download."""
import json
import os

# role markers are special tokens; an assistant turn ends with <|end|> (the eos token); tool calls are
# rendered as JSON inside <|call|> ... <|/call|> after the content
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|tool|>{{ m['tool_call_id'] }}\n{{ m['content'] }}<|end|>\n"
    "{% else %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<|call|>{{ c['id'] }} {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] }}<|/call|>{% endfor %}{% endif %}"
    "<|end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# like CHAT_TEMPLATE, but earlier assistant reasoning is dropped once a later user message follows
# (the re-rendering some reasoning models' templates do)
REASONING_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['role'] == 'assistant' and m['reasoning_content'] and loop.index0 > ns.last_user %}"
    "<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{{ m['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SPECIAL = ["<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|call|>", "<|/call|>",
           "<|developer|>"]


def build_tokenizer(path: str, corpus, template: str = CHAT_TEMPLATE, vocab_size: int = 400) -> str:
    """Train a byte-level BPE on ``corpus`` (strings) and save it with ``template`` under ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(corpus), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|end|>")
    fast.chat_template = template
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return path


def corpus_of(rows):
    """Every text of messages rows (contents, reasoning, tool calls) for training the BPE."""
    for r in rows:
        for m in r["messages"]:
            yield m.get("content") or ""
            if m.get("reasoning_content"):
                yield m["reasoning_content"]
            for c in m.get("tool_calls") or ():
                yield json.dumps(c)
