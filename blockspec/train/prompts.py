"""Chat instructions built from text that ships offline (DESIGN §6): CPython stdlib sources
(functions and classes), documentation paragraphs under /usr/share/doc, man pages, general
tasks (writing, explaining, extracting) about topics taken from those, and arithmetic word
problems made up here. Never from benchmark sets (HumanEval, MT-Bench, GSM8K): those measure us.

`blockspec train --write-prompts FILE` writes them (one JSON string a line) for a machine that
lacks these sources, where `blockspec train --prompts FILE` reads them."""

import ast
import gzip
import json
import random
import re
import sysconfig
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

DOC_ROOT = Path("/usr/share/doc")
MAN_ROOT = Path("/usr/share/man")
MAX_CODE_LINES = 40
PER_FILE = 3  # prompts taken from one file at most, for variety
PER_FAMILY = 20  # man pages of one family (name prefix) at most

TEXT_TASKS = [
    "Summarize the following text:\n\n{}",
    "Explain this to a beginner:\n\n{}",
    "What are the key points of this passage?\n\n{}",
    "Rewrite this paragraph in plain, clear English:\n\n{}",
]
MAN_TASKS = [
    "How do I use `{}` ({})? Give a short example.",
    "Explain what `{}` is for: {}.",
    "Write a short tutorial on `{}` ({}).",
]
STUB_TASKS = [  # a function's signature and docstring, the body left to write
    "Complete the following Python function.\n\n{}",
    "Implement this Python function:\n\n```python\n{}\n```",
    "Fill in the body of this function.\n\n{}",
]
TOPIC_TASKS = [  # {} is a topic: what a program does, e.g. "list directory contents"
    "Write a short blog post about tools that {}.",
    "Write a poem about a program that can {}.",
    "Give three pros and three cons of a tool that can {}.",
    "You are a senior engineer. A new colleague asks why anyone would need to {}. Answer them.",
    "Write an email to your team proposing a script to {}.",
    "Describe step by step how you would {} without special tools.",
    "Write a short story in which someone has to {}.",
    "Pretend you are a tired system administrator who must {} before dawn. Describe your night.",
    "How has the need to {} changed the way people work with computers? Answer in two paragraphs.",
    "Compare two different approaches to {}, and say which you would choose and why.",
    "Write a persuasive paragraph arguing that every beginner should learn to {}.",
    "Explain to a ten-year-old what it means to {}.",
    "Write a dialogue between a teacher and a student about how to {}.",
]
EXTRACT_TASKS = [
    "Extract every command, file name or option mentioned in this text, as a JSON list:\n\n{}",
    "Write three questions a reader could answer from this text, with their answers:\n\n{}",
    "Summarize this text in one sentence, then list its main terms:\n\n{}",
]
ITEMS = ["apples", "books", "tickets", "pencils", "boxes", "cups of coffee", "shirts", "plants"]


def read_text(path: Path) -> str:
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile):
        return ""
    return data.decode("utf-8", errors="replace")


# --- Python sources -------------------------------------------------------------------------


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}  # never installed packages
    return sorted(f for f in root.rglob("*.py") if not skip & set(f.relative_to(root).parts))


def code_task(node: ast.AST, code: str, rng: random.Random) -> str | None:
    kind = "class" if isinstance(node, ast.ClassDef) else "function"
    doc = ast.get_docstring(node)
    lines = code.splitlines()[:MAX_CODE_LINES]
    choice = rng.randrange(8)
    if choice >= 4 and doc and kind == "function":  # half the documented functions: a stub, as HumanEval asks
        return rng.choice(STUB_TASKS).format(stub(node, doc))
    if choice == 0 and doc:
        header = node.name if kind == "class" else f"{node.name}({ast.unparse(node.args)})"
        return f"Write a Python {kind} `{header}` that does the following:\n\n{doc.split(chr(10) * 2)[0]}"
    if choice == 1 and len(lines) >= 6:
        head = "\n".join(lines[: len(lines) // 2])
        return f"Continue this Python code:\n\n```python\n{head}\n```"
    if choice == 2:
        return "Review this Python code and suggest improvements:\n\n```python\n" + "\n".join(lines) + "\n```"
    return f"Explain what this Python {kind} does:\n\n```python\n" + "\n".join(lines) + "\n```"


def stub(node: ast.FunctionDef | ast.AsyncFunctionDef, doc: str) -> str:
    """`def name(args):` and the docstring, as the function would start."""
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    body = textwrap.indent(f'"""{doc}\n"""', "    ")
    return f"{prefix} {node.name}({ast.unparse(node.args)}){returns}:\n{body}\n"


def code_prompts(path: Path, rng: random.Random) -> list[str]:
    source = read_text(path)
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines, prompts = source.splitlines(), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            code = lines[node.lineno - 1 : node.end_lineno]
            if len(code) >= 3:
                prompts.append(code_task(node, textwrap.dedent("\n".join(code)), rng))
    return [p for p in prompts if p]


# --- documentation paragraphs ---------------------------------------------------------------


def doc_files() -> list[Path]:
    if not DOC_ROOT.is_dir():
        return []
    wanted = re.compile(r"^(readme|news|faq|todo)|\.(md|txt|rst)$", re.IGNORECASE)
    return sorted(f for f in DOC_ROOT.rglob("*") if f.is_file() and wanted.search(f.name.removesuffix(".gz")))


def prose(paragraph: str) -> bool:
    letters = sum(c.isalpha() or c.isspace() for c in paragraph)
    return 200 <= len(paragraph) <= 1500 and letters > 0.85 * len(paragraph)


def doc_prompts(path: Path, rng: random.Random) -> list[str]:
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", read_text(path))]
    return [rng.choice(TEXT_TASKS + EXTRACT_TASKS).format(p) for p in paragraphs if prose(p)]


# --- man pages ------------------------------------------------------------------------------


def man_files() -> list[Path]:
    """English man pages, at most PER_FAMILY of a family (gcloud alone has thousands)."""
    files, count = [], {}
    for f in sorted(MAN_ROOT.glob("man[1-8]/*")):
        family = re.split(r"[_.-]", f.name)[0]
        count[family] = count.get(family, 0) + 1
        if count[family] <= PER_FAMILY:
            files.append(f)
    return files


def man_name(path: Path) -> tuple[str, str] | None:
    """(name, what it does) from the NAME line ("ls \\- list directory contents")."""
    match = re.search(r"^\.SH\s+\"?NAME\"?\s*\n(.*?)(?=^\.S[HS])", read_text(path), re.MULTILINE | re.DOTALL)
    if not match:
        return None
    text = " ".join(line for line in match.group(1).splitlines() if not line.startswith("."))
    text = re.sub(r"\\f(\(..|\[[^]]*\]|.)|\\&|\\\*.", "", text).replace("\\-", "-").replace("\\", "")
    name, sep, what = text.partition(" - ")
    if not sep or not name.strip() or not what.strip():
        return None
    return name.strip(), what.strip().rstrip(".")


def man_prompts(path: Path, rng: random.Random) -> list[str]:
    named = man_name(path)
    return [task.format(*named) for task in MAN_TASKS] if named else []


def topic_prompts(path: Path, rng: random.Random) -> list[str]:
    """General tasks (writing, advice, a story, role play) about what a man page's program does."""
    named = man_name(path)
    return [task.format(named[1][0].lower() + named[1][1:]) for task in TOPIC_TASKS] if named else []


# --- arithmetic word problems (made up, never from GSM8K) ------------------------------------


def word_problems(rng: random.Random) -> Iterator[str]:
    while True:
        a, b, c = rng.randint(2, 40), rng.randint(2, 12), rng.randint(1, 9)
        item = rng.choice(ITEMS)
        problems = [
            f"A shop sells {item} at ${b} each. Sam buys {a} and pays ${a * b + 5 * c}. How much change does Sam get?",
            f"{a * b + c} {item} are shared equally among {b} people. How many does each get, and how many are left?",
            f"Solve for x: {b}x + {a} = {b * c + a}.",
            f"A train covers {a * 10} km in {b} hours. At that speed, how far does it go in {b + c} hours?",
            f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?",
            f"Ann is {a} years old and {b} years older than Ben. How old will Ben be in {c} years?",
            f"A {item.rstrip('s')} costs ${a * 10}. It is discounted by {b * 5}%. What is the new price?",
            f"What is {a * b} divided by {b}, plus {c} squared?",
        ]
        yield rng.choice(problems) + " " + rng.choice(["Explain your reasoning.", "Show your work step by step."])


# --- the mix --------------------------------------------------------------------------------


def from_files(
    files: list[Path], extract: Callable[[Path, random.Random], list[str]], rng: random.Random
) -> Iterator[str]:
    """A few prompts from every file first (variety), then the rest (depth)."""
    files, rest = list(files), []
    rng.shuffle(files)
    for f in files:
        items = extract(f, rng)
        rng.shuffle(items)
        yield from items[:PER_FILE]
        rest.extend(items[PER_FILE:])
    rng.shuffle(rest)
    yield from rest


def build_prompts(n: int, seed: int = 0) -> list[str]:
    """n distinct instructions: 35% from code, 20% from docs, 25% general tasks, 10% each from
    man pages and word problems (a source that runs dry leaves its share to the others; the
    templated word problems never pass a tenth of the prompts so far). Deterministic for a seed,
    and prompt i does not depend on n: a longer list extends a shorter one, so data generated
    for fewer prompts is extended, not answered again."""
    rng = random.Random(seed)
    words = word_problems(rng)
    sources = [
        [3.5, from_files(stdlib_files(), code_prompts, rng)],
        [2.0, from_files(doc_files(), doc_prompts, rng)],
        [2.5, from_files(man_files(), topic_prompts, rng)],
        [1.0, from_files(man_files(), man_prompts, rng)],
        [1.0, words],
    ]
    prompts, seen, num_words = [], set(), 0
    while len(prompts) < n and sources:
        source = rng.choices(sources, weights=[w for w, _ in sources])[0]
        if source[1] is words and num_words > len(prompts) // 10:
            if len(sources) == 1:
                break  # only word problems are left
            continue
        prompt = next(source[1], None)
        if prompt is None:
            sources.remove(source)
        elif prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
            num_words += source[1] is words
    return prompts


def read_prompts(path: str | Path) -> list[str]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_prompts(prompts: list[str], path: str | Path) -> None:
    Path(path).write_text("".join(json.dumps(p) + "\n" for p in prompts))
