"""The manual's commands and links point at things that exist: README.md and docs/*.md, checked without running models.

For every command in a ```bash block (backslash continuations joined, comments dropped) and every inline `code`
span that starts with one of our commands:
  draftheads VERB ...                    VERB is one of the command's verbs (`draftheads train` names a trainer)
  python -m MOD ...                      MOD is found (`importlib.util.find_spec`), for modules of our packages
  python path/x.py, PYTHONPATH=. python scripts/x.py, accelerate launch [flags] train/x.py   the file exists
  accelerate launch [flags] -m MOD ...   MOD is found
  --config FILE, --config_file FILE      the file exists
  bash scripts/x.sh                      the file exists
Commands that are not ours (pip, git, hf, vllm, sglang, cd, ...) are skipped. Every relative markdown link
[text](path#anchor) resolves to a file, and an anchor to a heading on that page (GitHub's slugs).
"""

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

OUR_PACKAGES = ("draftheads", "data", "models", "eval", "train", "scripts")
NOT_OURS = {"pip", "pip3", "hf", "huggingface-cli", "git", "cd", "export", "vllm", "python3", "source", "ls",
            "mkdir", "rm", "cp", "mv", "cat", "echo", "curl", "wget", "xz", "torchrun", "nvidia-smi", "sudo"}
WRAPPERS = {"time", "env", "nohup"}
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
# flags of `accelerate launch` that take a value (everything else before the script is a switch)
ACCELERATE_VALUE_FLAGS = {
    "--config_file", "--num_processes", "--num_machines", "--machine_rank", "--main_process_ip",
    "--main_process_port", "--num_cpu_threads_per_process", "--mixed_precision", "--gpu_ids", "--dynamo_backend",
    "--deepspeed_config_file", "--rdzv_backend", "--same_network", "--fsdp_sharding_strategy",
}
PLACEHOLDERS = {"...", "…"}
#: generated pages (each says so in its first line), outside the hand-written budget; docs/benchmarks/ holds reports
GENERATED = {"reference.md", "reliability-catalogue.md"}
DOCS_BUDGET = 1500       # lines of the hand-written pages of docs/ together
README_BUDGET = 100


def code_lines(text: str):
    """(line number, command) for each command of each ```bash block and each inline code span outside blocks."""
    lines = text.split("\n")
    out, in_block, lang, pending, start = [], False, "", "", 0
    prose = []
    for i, line in enumerate(lines, 1):
        fence = re.match(r"^\s*```(\S*)", line)
        if fence:
            if not in_block:
                in_block, lang = True, fence.group(1)
            else:
                in_block = False
            prose.append("")
            continue
        if not in_block:
            prose.append(line)
            continue
        prose.append("")
        if lang not in ("bash", "sh", "shell", "console"):
            continue
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            start = i
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        out.append((start, pending + stripped))
        pending = ""
    # inline code spans (they may wrap across lines); block lines were blanked above so offsets stay right
    body = "\n".join(prose)
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", body):
        span = " ".join(m.group(1).split())
        words = [w for w in span.split(" ") if not ENV_ASSIGNMENT.match(w)]
        if words and words[0] in ("python", "accelerate", "bash", "draftheads"):
            out.append((body.count("\n", 0, m.start()) + 1, span))
    return sorted(out)


def split_command(cmd: str) -> list[str] | None:
    try:
        return shlex.split(cmd, comments=True)
    except ValueError:
        return None


def problems_of(words: list[str]) -> list[str]:
    """What is wrong with one command line (empty when nothing is, or when the command is not ours)."""
    while words and (ENV_ASSIGNMENT.match(words[0]) or words[0] in WRAPPERS):
        words = words[1:]
    if not words or words[0] in NOT_OURS:
        return []
    found = []
    head, rest = words[0], words[1:]
    if head == "python":
        if rest[:1] == ["-m"] and len(rest) > 1:
            found += module_problems(rest[1])
        elif rest and rest[0].endswith(".py"):
            found += file_problems(rest[0])
        else:
            return []
    elif head == "accelerate":
        if rest[:1] != ["launch"]:
            return []
        args, j = rest[1:], 0
        while j < len(args) and args[j].startswith("-") and args[j] != "-m":
            j += 2 if args[j] in ACCELERATE_VALUE_FLAGS and "=" not in args[j] else 1
        if j < len(args) and args[j] == "-m" and j + 1 < len(args):
            found += module_problems(args[j + 1])
        elif j < len(args) and args[j].endswith(".py"):
            found += file_problems(args[j])
    elif head == "bash":
        if rest and rest[0].endswith(".sh"):
            found += file_problems(rest[0])
    elif head == "draftheads":
        found += verb_problems(rest)
    else:
        return []
    for k, word in enumerate(words):
        value = None
        if word in ("--config", "--config_file") and k + 1 < len(words):
            value = words[k + 1]
        elif word.startswith(("--config=", "--config_file=")):
            value = word.split("=", 1)[1]
        if value is not None and value not in PLACEHOLDERS:
            found += file_problems(value)
    return found


def verb_problems(rest: list[str]) -> list[str]:
    from draftheads.cli import TRAINERS, VERBS

    if not rest or rest[0].startswith("-") or rest[0] in PLACEHOLDERS:
        return []
    if rest[0] not in VERBS:
        return [f"no verb {rest[0]!r} (draftheads has {', '.join(VERBS)})"]
    if rest[0] == "train" and (len(rest) < 2 or rest[1] not in TRAINERS):
        return [f"`draftheads train` takes a trainer first ({', '.join(TRAINERS)})"]
    return []


def module_problems(module: str) -> list[str]:
    if module.split(".")[0] not in OUR_PACKAGES:
        return []
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    return [] if spec is not None else [f"no module {module!r}"]


def file_problems(path: str) -> list[str]:
    if any(ch in path for ch in "$*{}<>") or path in PLACEHOLDERS:
        return []
    return [] if (ROOT / path).is_file() else [f"no file {path!r}"]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)      # links keep their text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_block = False
    for line in path.read_text().split("\n"):
        if re.match(r"^\s*```", line):
            in_block = not in_block
            continue
        m = None if in_block else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path):
    """(line, target) for each markdown link outside code blocks and code spans."""
    in_block = False
    for i, line in enumerate(path.read_text().split("\n"), 1):
        if re.match(r"^\s*```", line):
            in_block = not in_block
            continue
        if in_block:
            continue
        line = re.sub(r"`[^`]*`", "", line)
        for m in re.finditer(r"\]\(([^)\s]+)\)", line):
            yield i, m.group(1)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_docs_exist():
    assert (ROOT / "docs" / "README.md").is_file()
    assert len(DOCS) > 2, DOCS


def test_readme_is_a_front_door():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_BUDGET, f"README.md has {n} lines (at most {README_BUDGET}); the manual belongs in docs/"


def handwritten(docs_dir: Path) -> list[Path]:
    """The manual's hand-written pages: docs/*.md less the generated ones (docs/benchmarks/ is not globbed)."""
    return [p for p in sorted(docs_dir.glob("*.md")) if p.name not in GENERATED]


GENERATED_SECTION = re.compile(r"^<!-- (bench_peers \S+) -->$")  # a section a script rewrites between two markers


def handwritten_lines(text: str) -> int:
    """Lines of a page less the sections a script writes (between two equal `<!-- bench_peers NAME -->` lines)."""
    n, inside, held = 0, None, 0
    for line in text.splitlines():
        m = GENERATED_SECTION.match(line.strip())
        if m and inside is None:
            inside, held = m.group(1), 1
        elif m and m.group(1) == inside:
            inside, held = None, 0
        elif inside is None:
            n += 1
        else:
            held += 1
    return n + held  # a section that never closes is not a script's: it counts


def test_the_manual_keeps_its_budget():
    pages = handwritten(ROOT / "docs")
    counts = {p.name: handwritten_lines(p.read_text()) for p in pages}
    total = sum(counts.values())
    assert total <= DOCS_BUDGET, (f"the hand-written pages of docs/ have {total} lines, at most {DOCS_BUDGET}: "
                                  + ", ".join(f"{n} {c}" for n, c in sorted(counts.items(), key=lambda x: -x[1])))


MONTHS = ("january|february|march|april|may|june|july|august|september|october|november|december|"
          "jan|feb|mar|apr|jun|jul|aug|sep|sept|oct|nov|dec")
HISTORY = re.compile(rf"\b\d{{4}}-\d{{2}}-\d{{2}}\b|\b(?:{MONTHS})\.?\s+(?:\d{{1,2}},?\s+)?\d{{4}}\b"
                     rf"|\b\d{{1,2}}\s+(?:{MONTHS})\.?\s+\d{{4}}\b|\bsessions?\b|\bfirst figures\b", re.I)


def history_headings(text: str) -> list[str]:
    """Headings (outside code blocks) that name a date or a session: a page says what is, git keeps history."""
    out, in_block = [], False
    for line in text.split("\n"):
        if re.match(r"^\s*```", line):
            in_block = not in_block
            continue
        if not in_block and re.match(r"^#{1,6}\s", line) and HISTORY.search(line):
            out.append(line.strip())
    return out


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_no_heading_tells_history(doc):
    bad = history_headings(doc.read_text())
    assert not bad, f"{rel(doc)}: headings naming a date or a session: {bad}"


def test_the_budget_and_history_checks_can_fail(tmp_path):
    (tmp_path / "a.md").write_text("x\n" * 3)
    (tmp_path / "reference.md").write_text("x\n" * 5000)
    assert [p.name for p in handwritten(tmp_path)] == ["a.md"]
    page = "a\n<!-- bench_peers tiny -->\n### t\n| x |\n<!-- bench_peers tiny -->\nb\n"
    assert handwritten_lines(page) == 2 and handwritten_lines(page.replace("tiny -->\nb", "other -->\nb")) == 6
    assert history_headings("# Benchmarks\n### First figures: one H200 (2026-12-04)\n") == [
        "### First figures: one H200 (2026-12-04)"]
    assert history_headings("## Second session: one H200\n## Run of December 2026\n## 4 Dec 2026\n") == [
        "## Second session: one H200", "## Run of December 2026", "## 4 Dec 2026"]
    assert history_headings("## GPU (H200)\n```\n# session 2026-12-04\n```\n## May the 4th\n") == []


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_commands_point_at_what_exists(doc):
    bad = []
    for line, cmd in code_lines(doc.read_text()):
        words = split_command(cmd)
        if words is None:
            bad.append(f"{rel(doc)}:{line}: cannot parse {cmd!r}")
            continue
        bad += [f"{rel(doc)}:{line}: {p}: {cmd}" for p in problems_of(words)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_links_resolve(doc):
    bad = []
    for line, target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            bad.append(f"{rel(doc)}:{line}: link to missing {file_part!r}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{rel(doc)}:{line}: no heading #{anchor} in {rel(dest)}")
    assert not bad, "\n".join(bad)


def test_the_checker_catches_mistakes():
    """The checks themselves: a wrong module, file or config is named; commands not ours pass."""
    assert problems_of(shlex.split("python -m draftheads.eval.no_such_module --x 1"))
    assert problems_of(shlex.split("accelerate launch --num_processes 2 train/nope.py --config configs/medusa-tiny.yaml"))
    assert problems_of(shlex.split("accelerate launch train/medusa.py --config configs/nope.yaml"))
    assert problems_of(shlex.split("PYTHONPATH=. python scripts/nope.py"))
    assert problems_of(shlex.split("bash scripts/nope.sh"))
    assert not problems_of(shlex.split("accelerate launch --config_file configs/accelerate/fsdp.yaml "
                                       "--num_processes 8 train/medusa.py --config configs/llama3-8b-medusa.yaml"))
    assert not problems_of(shlex.split("pip install deepspeed"))
    assert not problems_of(shlex.split("python -m sglang.launch_server --model x"))
    text = "```bash\npython -m draftheads.eval \\\n    --out x   # note\n# comment\n```\nand `python scripts/a.py\nb`\n"
    assert code_lines(text) == [(2, "python -m draftheads.eval --out x   # note"), (6, "python scripts/a.py b")]
    assert slug("Evaluate drafters (`python -m eval`)") == "evaluate-drafters-python--m-eval"
    assert problems_of(shlex.split("draftheads evaluate --out x")) and problems_of(shlex.split("draftheads train x"))
    assert not problems_of(shlex.split("draftheads train eagle --config configs/eagle3-tiny.yaml"))
    assert problems_of(shlex.split("draftheads train eagle --config configs/nope.yaml"))
    assert slug("The train/serve check") == "the-trainserve-check"
