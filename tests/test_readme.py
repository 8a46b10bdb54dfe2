"""The README's flags table cannot drift from the parsers: every flag it names exists, and the choices it lists are
the parser's. The fork's own flags come from `options.add_args` (the parser both engines extend); upstream's flags
the table names (`--advantage_estimator`, `--actor.entropy_coef`, ...) are checked against the local engine's parser,
which mirrors their names (`local.flags.build_parser`)."""

import argparse
import re
from pathlib import Path

import pytest

from openrlhf_geo import options
from openrlhf_geo.local.flags import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FORK_NAMESPACES = ("--salt.", "--geoalign.", "--reward.noise.", "--baseline.")


def fork_parser():
    return options.add_args(argparse.ArgumentParser())


def flags_table(text):
    """The rows of the table whose header is `| flag | choices | meaning |`: (line, flag cell, choices cell, row)."""
    lines = text.splitlines()
    start = next(
        i for i, line in enumerate(lines) if re.fullmatch(r"\|\s*flag\s*\|\s*choices\s*\|\s*meaning\s*\|", line)
    )
    rows = []
    for number, line in enumerate(lines[start + 2 :], start + 3):
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        assert len(cells) == 3, f"README.md:{number}: a flags-table row needs 3 cells: {line}"
        rows.append((number, *cells))
    return rows


def expand(flag):
    """`--a.{b,c}` -> [`--a.b`, `--a.c`]."""
    match = re.fullmatch(r"(--[\w.]*)\{([\w,]+)\}", flag)
    return [match[1] + part for part in match[2].split(",")] if match else [flag]


def flags_in(cell):
    """Every flag a cell names in backticks (the first word of each code span that starts with --)."""
    spans = re.findall(r"`([^`]+)`", cell)
    return [f for span in spans if span.startswith("--") for f in expand(span.split()[0].rstrip(","))]


def choices_in(cell):
    return {span for span in re.findall(r"`([^`]+)`", cell)}


def check_table(text):
    """The problems of a README text's flags table, as a list of messages (empty: the table matches the parsers)."""
    fork, local = fork_parser(), build_parser()
    fork_help, local_help = fork.format_help(), local.format_help()
    problems = []
    rows = flags_table(text)
    if len(rows) < 15:
        problems.append(f"the flags table has {len(rows)} rows")
    for number, flag_cell, choices_cell, meaning in rows:
        subjects = flags_in(flag_cell)
        if not subjects:
            problems.append(f"README.md:{number}: no flag in the first cell")
        for flag in subjects + flags_in(meaning):
            if flag.startswith(FORK_NAMESPACES):
                if flag not in fork._option_string_actions or flag not in fork_help:
                    problems.append(f"README.md:{number}: {flag} is not in the fork's --help (options.add_args)")
            elif flag not in local._option_string_actions or flag not in local_help:
                problems.append(f"README.md:{number}: {flag} is not in the local engine's --help")
        listed = choices_in(choices_cell)
        actions = {**local._option_string_actions, **fork._option_string_actions}
        with_choices = [f for f in subjects if f in actions and actions[f].choices is not None]
        if len(with_choices) > 1:
            problems.append(f"README.md:{number}: one row per flag with choices ({', '.join(with_choices)})")
            continue
        if not with_choices:
            if listed:
                problems.append(f"README.md:{number}: choices {sorted(listed)} listed for a flag without choices")
            continue
        (flag,) = with_choices
        if flag.startswith(FORK_NAMESPACES):
            actual = set(fork._option_string_actions[flag].choices)
            if listed != actual:
                problems.append(f"README.md:{number}: {flag} lists {sorted(listed)}, the parser has {sorted(actual)}")
        else:  # upstream's flag: the fork's parser is upstream's with more values; the ones listed must exist
            actual = set(local._option_string_actions[flag].choices)
            if not listed or not listed <= actual:
                problems.append(f"README.md:{number}: {flag} lists {sorted(listed)}, not among {sorted(actual)}")
    return problems


def test_every_flag_and_choice_in_the_readme_flags_table_matches_the_parsers():
    assert check_table(README.read_text()) == []


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("| `--salt.gram` |", "| `--salt.grams` |", "--salt.grams is not in the fork's --help"),
        ("`raw`, `shrink`", "`raw`, `shrunk`", "--salt.gram lists ['raw', 'shrunk']"),
        ("`replace`, `zero`, `amplify`, `drop`", "`replace`, `zero`, `amplify`", "--geoalign.mode lists"),
        ("upstream's, plus `salt`", "upstream's, plus `salty`", "--advantage_estimator lists ['salty']"),
        ("`--algo.advantage.estimator`", "`--algo.advantage.estimate`", "--algo.advantage.estimate is not in"),
        ("projector.{hidden_sizes,", "projector.{hidden_size,", "--geoalign.projector.hidden_size is not in"),
    ],
)
def test_the_table_check_fails_on_a_broken_copy(old, new, message):
    """A scratch copy of the README with one flag or choice broken fails the check (the README itself is untouched)."""
    text = README.read_text()
    assert old in text
    problems = check_table(text.replace(old, new, 1))
    assert any(message in problem for problem in problems), problems


def test_fork_flags_named_anywhere_in_the_readme_and_usage_doc_exist():
    """Outside the table too: every `--salt.*`, `--geoalign.*`, `--reward.noise.*`, `--baseline.*` flag the README and
    docs/usage.md name is one of the fork's."""
    fork = fork_parser()
    names = set()
    for path in (README, ROOT / "docs" / "usage.md"):
        for span in re.findall(r"--(?:salt|geoalign|reward\.noise|baseline)\.[\w.{},]+", path.read_text()):
            names.update(expand(span.rstrip(".,")))
    assert len(names) > 30
    assert sorted(n for n in names if n not in fork._option_string_actions) == []


def test_the_readme_stays_within_180_lines():
    """Details live in docs/; the README is the entry point (the demo, the install, the fork, the flags table)."""
    assert len(README.read_text().splitlines()) <= 180


def slug(heading):
    """GitHub's anchor of a markdown heading: lower case, punctuation other than '-' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(path):
    """The relative links of a markdown file whose file, or #anchor in a markdown file, does not exist."""
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            problems.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", resolved.read_text(), flags=re.MULTILINE)
            if anchor not in {slug(h) for h in headings}:
                problems.append(f"{target}: no heading with that anchor")
    return problems


def test_every_relative_link_of_the_readme_resolves():
    assert broken_links(README) == []
    assert slug("The demo (`bash scripts/demo.sh`)") == "the-demo-bash-scriptsdemosh"


def test_the_link_check_reports_a_missing_file_and_a_missing_anchor(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Set-up and test times\n")
    page.write_text("[a](other.md#set-up-and-test-times) [b](other.md#nothing) [c](gone.md) [d](https://x.org/y)\n")
    assert broken_links(page) == ["other.md#nothing: no heading with that anchor", "gone.md: no such file"]
