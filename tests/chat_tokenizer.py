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

# a reasoning model's template (Qwen3-like): BOS, a default system prompt when the conversation has
# none, <think> shown only on assistant turns after the last user message (reasoning given as a
# field or inside the content), tool calls as JSON in tags, consecutive tool results in one block
QWEN_LIKE_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] != 'system' %}<|system|>\nYou are a helpful assistant.<|end|>\n{% endif %}"
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|user|>\n{% endif %}"
    "<tool_response>\n{{ m['content'] }}\n</tool_response>\n"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|end|>\n{% endif %}"
    "{% elif m['role'] == 'assistant' %}"
    "{% set content = m['content'] or '' %}"
    "{% set reasoning = m['reasoning_content'] if m['reasoning_content'] is string else '' %}"
    "{% if '</think>' in content %}{% set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "<|assistant|>\n"
    "{% if loop.index0 > ns.last_user %}<think>{{ reasoning }}</think>{% endif %}"
    "{{ content }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] }}}</tool_call>{% endfor %}"
    "<|end|>\n"
    "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SPECIAL = ["<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|call|>", "<|/call|>",
           "<|developer|>", "<|bos|>"]


def build_tokenizer(path: str, corpus, template: str = CHAT_TEMPLATE, vocab_size: int = 400) -> str:
    """Train a byte-level BPE on ``corpus`` (strings) and save it with ``template`` under ``path``
    (its BOS token is ``<|bos|>``, which only a template that writes ``bos_token`` uses)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(corpus), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|end|>",
                                   bos_token="<|bos|>")
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
