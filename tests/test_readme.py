"""Every CPU command of README.md (and of the docs pages listed in DOCS) runs, so they cannot go stale.

The README's fenced ```bash and ```python blocks run in document order in the repository root:
a bash block line by line (backslash continuations joined, comment lines skipped), each line
under ``bash -e`` with the running interpreter's directory first on PATH, so ``python`` is the
test's (the virtual environment's); a python block as one script with ``sys.executable``.
A block that must not run here (the quick start's own jobs, GPU commands, minutes-long
training) carries the line ``<!-- not run by tests/test_readme.py: REASON -->`` immediately
before its fence.  Commands write only under ``out/`` (ignored by git): the test checks that
``git status`` gains no entry.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import List, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
MESSAGES_DOC = os.path.join(ROOT, "docs", "messages.md")
MARKER = re.compile(r"^<!--\s*not run by tests/test_readme\.py:\s*(.*?)\s*-->$")
MIN_RUN_BLOCKS = 4
COMMAND_LANGUAGES = ("bash", "python")


@dataclass
class Block:
    language: str
    line: int                 # 1-based README line of the opening fence
    lines: List[str]          # the block's text lines
    skip_reason: Optional[str]

    def first_line(self) -> str:
        return next((x for x in self.lines if x.strip()), "")


def readme_blocks(text: str) -> List[Block]:
    """Fenced code blocks of a Markdown text, with the not-run marker of the line before each."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        assert j < len(lines), f"README.md:{i + 1}: fence never closed"
        marker = MARKER.match(lines[i - 1].strip()) if i > 0 else None
        blocks.append(Block(m.group(1), i + 1, lines[i + 1:j], None if marker is None else marker.group(1)))
        i = j + 1
    return blocks


def bash_commands(block: Block):
    """(README line, command) per logical line: continuations joined, blank and comment lines dropped."""
    out, pending, start = [], "", None
    for k, raw in enumerate(block.lines):
        line_no = block.line + 1 + k
        if not pending and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        if start is None:
            start = line_no
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        out.append((start, pending + raw))
        pending, start = "", None
    assert not pending, f"README.md:{block.line}: block ends in a backslash continuation"
    return out


def git_status() -> set:
    r = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                       capture_output=True, text=True)
    return set(r.stdout.splitlines()) if r.returncode == 0 else set()


def test_readme_markers_and_parsing():
    """Every bash/python block either runs or says why not; the parser finds what the README holds."""
    blocks = readme_blocks(open(README).read())
    commands = [b for b in blocks if b.language in COMMAND_LANGUAGES]
    for b in commands:
        assert b.skip_reason is None or b.skip_reason, f"README.md:{b.line}: not-run marker without a reason"
    assert sum(b.skip_reason is None for b in commands) >= MIN_RUN_BLOCKS
    assert any(b.skip_reason for b in commands), "the quick start's own jobs must be marked not run"
    # the parser itself: a marker binds only to the fence right below it, continuations join
    sample = ("<!-- not run by tests/test_readme.py: GPU -->\n```bash\na \\\n  b\n# c\nd\n```\n\n"
              "```python\nx = 1\n```\n")
    got = readme_blocks(sample)
    assert [(b.language, b.skip_reason) for b in got] == [("bash", "GPU"), ("python", None)]
    assert bash_commands(got[0]) == [(3, "a    b"), (6, "d")]


def run_blocks(path: str, extra_env=None) -> int:
    """Run the runnable blocks of the Markdown file ``path`` in order (module docstring); the number run."""
    name = os.path.relpath(path, ROOT)
    blocks = [b for b in readme_blocks(open(path).read())
              if b.language in COMMAND_LANGUAGES and b.skip_reason is None]
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               MPLBACKEND="Agg", OMP_NUM_THREADS="1", **(extra_env or {}))
    before = git_status()
    ran = 0
    for b in blocks:
        if b.language == "bash":
            steps = [(line, ["bash", "-e", "-c", cmd]) for line, cmd in bash_commands(b)]
        else:
            steps = [(b.line, [sys.executable, "-c", "\n".join(b.lines)])]
        for line, argv in steps:
            r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
            if r.returncode != 0:
                pytest.fail(f"{name}:{line} (block at line {b.line}, starting {b.first_line()!r}) exited "
                            f"{r.returncode}; stderr tail:\n{r.stderr[-2000:]}")
        ran += 1
    new = sorted(git_status() - before)
    assert not new, f"{name}'s commands changed files outside out/: {new}"
    return ran


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_readme_commands_run():
    """Each runnable block succeeds, in README order, and nothing outside out/ changes."""
    assert run_blocks(README) >= MIN_RUN_BLOCKS


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_messages_doc_commands_run(tmp_path):
    """docs/messages.md's commands, with TOKDIR a small chat tokenizer built here (no download) and
    REASONING_TOKDIR one whose template drops earlier reasoning after a user message (Qwen3-like)."""
    pytest.importorskip("tokenizers")
    from chat_tokenizer import QWEN_LIKE_TEMPLATE, build_tokenizer, corpus_of
    from megatron_harts.tree_data.agent_logs import AgentLogConfig, synthesize_agent_logs
    tok = build_tokenizer(str(tmp_path / "tok"), corpus_of(synthesize_agent_logs(AgentLogConfig(num_tasks=3, seed=11))))
    rows = synthesize_agent_logs(AgentLogConfig(num_tasks=3, seed=11, reasoning_words=10, followup_prob=0.3))
    reasoning = build_tokenizer(str(tmp_path / "rtok"), corpus_of(rows), template=QWEN_LIKE_TEMPLATE)
    assert run_blocks(MESSAGES_DOC, {"TOKDIR": tok, "REASONING_TOKDIR": reasoning}) >= 3
