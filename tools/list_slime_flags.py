"""Regenerate the list of slime's own flags that hpc_rl answers for (`hpc_rl/config/slime_arguments.tsv`).

    python tools/list_slime_flags.py [--slime-repo /work/.mirror/THUDM+slime/repo] [--rev HEAD]

It reads `slime/utils/arguments.py` at REV straight from slime's git directory (no checkout, no import:
slime needs Ray, Megatron and SGLang to import) and walks its syntax tree: every `add_argument(...)` and
`reset_arg(parser, "--x", ...)` call with a `--` option string is one flag. Each line of the output is
`--flag<TAB>group<TAB>kind<TAB>type<TAB>choices<TAB>default`, where group is the `add_<group>_arguments`
function that defines it (`mode` for the flags `_pre_parse_mode` reads first, `misc` for the two at the top level), kind is switch (takes no
value), value or values (nargs), type the declared type's name (json for `json.loads`), choices `|`-joined.
The header names the slime commit and its date. `tests/unit/test_slime_flag_walk.py` walks this list.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "hpc_rl" / "config" / "slime_arguments.tsv"
ARGUMENTS_PATH = "slime/utils/arguments.py"
SWITCH_ACTIONS = ("store_true", "store_false", "BooleanOptionalAction")


@dataclass(frozen=True)
class SlimeFlag:
    flag: str
    group: str
    kind: str
    type: str
    choices: str
    default: str

    def line(self) -> str:
        return "\t".join((self.flag, self.group, self.kind, self.type, self.choices, self.default))


def _literal(node: ast.AST | None) -> object:
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def _group(function_name: str) -> str:
    if function_name == "_pre_parse_mode":
        return "mode"
    if function_name == "add_slime_arguments":
        return "misc"
    return function_name.removeprefix("add_").removesuffix("_arguments")


def _flag_of(call: ast.Call, function_name: str) -> SlimeFlag | None:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in ("add_argument", "reset_arg"):
        return None
    options = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
               and a.value.startswith("--")]
    if not options:
        return None  # reset_arg's own fallback call (parser.add_argument(name, **kwargs))
    keywords = {k.arg: k.value for k in call.keywords if k.arg}
    action = _literal(keywords.get("action"))
    action = action.rsplit(".", 1)[-1] if isinstance(action, str) else action
    nargs = _literal(keywords.get("nargs"))
    if action in SWITCH_ACTIONS:
        kind = "switch"
    elif nargs in ("+", "*") or action == "append":
        kind = "values"
    else:
        kind = "value"
    type_node = keywords.get("type")
    type_name = ast.unparse(type_node) if type_node is not None else ("bool" if kind == "switch" else "str")
    type_name = {"json.loads": "json"}.get(type_name, type_name)
    choices = _literal(keywords.get("choices"))
    default = _literal(keywords.get("default"))
    return SlimeFlag(flag=options[0], group=_group(function_name), kind=kind, type=type_name,
                     choices="|".join(map(str, choices)) if isinstance(choices, (list, tuple)) else "",
                     default="" if default is None else repr(default))


def slime_flags(source: str) -> list[SlimeFlag]:
    """Every flag `source` (slime's arguments.py) defines, in definition order."""
    flags: list[SlimeFlag] = []

    def walk(node: ast.AST, function_name: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, ast.FunctionDef) else function_name
            if isinstance(child, ast.Call) and (flag := _flag_of(child, function_name)) is not None:
                flags.append(flag)
            walk(child, name)

    walk(ast.parse(source), "")
    return flags


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, text=True).stdout


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slime-repo", default="/work/.mirror/THUDM+slime/repo", help="slime's git directory")
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    commit = _git(args.slime_repo, "rev-parse", args.rev).strip()
    date = _git(args.slime_repo, "show", "-s", "--format=%cs", commit).strip()
    flags = slime_flags(_git(args.slime_repo, "show", f"{commit}:{ARGUMENTS_PATH}"))
    header = (f"# THUDM/slime {commit} ({date}) {ARGUMENTS_PATH}: the {len(flags)} flags it defines.\n"
              "# --flag<TAB>group<TAB>kind<TAB>type<TAB>choices<TAB>default. Generated by tools/list_slime_flags.py; "
              "do not edit.\n")
    Path(args.out).write_text(header + "".join(f.line() + "\n" for f in flags))
    print(f"{len(flags)} flags of slime {commit[:10]} -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
