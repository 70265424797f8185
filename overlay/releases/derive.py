"""Each release fact read from the release's own tree (a :class:`overlay.releases.source.Tree`).

GLM-5's model class: its line in the model registry and the class the named module binds on CUDA
(its platform ``if`` taken as on a CUDA machine, imports followed). The default model runner: whether
Model Runner V1 is still there, and how ``VllmConfig.use_v2_model_runner`` decides (an architecture list,
or V2 for every model). The DCP defaults GLM-5 gets: ``ParallelConfig``'s fields, ``set_dcp_defaults``'
own defaults and GLM-5's config hook's call of it. Where the DCP ops live, and which direct paths
``VLLM_USE_DIRECT_DCP_A2A`` switches (its default from ``envs.py``), and how the build spells the switch
of the projection before the DCP merge (an engine argument, a variable, or none). A fact the tree does not show
raises :class:`Missing`, naming the file and what was looked for.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from overlay.releases.source import Tree

ARCH = "GlmMoeDsaForCausalLM"
VERSION_PY = "vllm/_version.py"
REGISTRY = "vllm/model_executor/models/registry.py"
ENVS = "vllm/envs.py"
VLLM_CONFIG = "vllm/config/vllm.py"
PARALLEL_CONFIG = "vllm/config/parallel.py"
MODEL_CONFIGS = "vllm/model_executor/models/config.py"
V1_RUNNER = "vllm/v1/worker/gpu_model_runner.py"
V2_RUNNER = "vllm/v1/worker/gpu/model_runner.py"
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
V2_ARCHITECTURES = "DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES"
DCP_OPS = ("vllm/v1/attention/ops/dcp.py", "vllm/v1/attention/ops/dcp_utils.py")  # newest first
INDEXER = "vllm/model_executor/layers/sparse_attn_indexer.py"
TOPK_DIRECT = "vllm/model_executor/kernels/attention/dsa/dcp_topk_direct.py"
DIRECT_A2A_ENV = "VLLM_USE_DIRECT_DCP_A2A"
PROJECTION_FIELD = "dcp_v_up_proj_before_merge"  # our 0.34.0 series' ParallelConfig field (an engine argument)
PROJECTION_ENV = "VLLM_DCP_PROJECT_BEFORE_MERGE"  # our 0.28.0 series' variable
_OTHER_PLATFORMS = ("is_rocm", "is_xpu", "is_cpu", "is_tpu")
_HOPS = 4  # imports followed from the registry's module to the class


class Missing(Exception):
    """A fact the tree does not show; the message names the file and what was looked for."""


def module_of(path: str) -> str:
    """``vllm/v1/attention/ops/dcp.py`` -> ``vllm.v1.attention.ops.dcp``."""
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _text(tree: Tree, path: str) -> str:
    text = tree.read(path)
    if text is None:
        raise Missing(f"{path}: not in the tree")
    return text


def _parse(tree: Tree, path: str) -> ast.Module:
    try:
        return ast.parse(_text(tree, path))
    except SyntaxError as exc:
        raise Missing(f"{path}:{exc.lineno}: not Python ({exc.msg})") from None


def _class(module: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in module.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _literal(node: ast.AST | None) -> Any:
    try:
        return ast.literal_eval(node) if node is not None else None
    except ValueError:
        return ast.unparse(node)


def release(tree: Tree) -> str:
    """The release (``x.y.z``, the local label dropped) of ``vllm/_version.py``."""
    found = re.search(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"+]+)""", _text(tree, VERSION_PY), re.M)
    if not found:
        raise Missing(f"{VERSION_PY}: no __version__ line")
    return found[1]


def model_class(tree: Tree, arch: str = ARCH) -> str:
    """``module.Class`` that ``arch``'s registry line resolves to on CUDA."""
    for node in ast.walk(_parse(tree, REGISTRY)):
        if not isinstance(node, ast.Dict):
            continue
        for key, value in zip(node.keys, node.values, strict=True):
            if isinstance(key, ast.Constant) and key.value == arch:
                entry = _literal(value)
                if not (isinstance(entry, tuple) and len(entry) == 2 and all(isinstance(e, str) for e in entry)):
                    raise Missing(f"{REGISTRY}: {arch}'s line is not (module, class): {ast.unparse(value)}")
                rel, name = entry
                module = rel if rel.startswith("vllm.") else f"vllm.model_executor.models.{rel}"
                return _bound_class(tree, module, name, _HOPS)
    raise Missing(f"{REGISTRY}: no registry line for {arch}")


def _module_file(tree: Tree, module: str) -> str | None:
    base = module.replace(".", "/")
    return next((p for p in (f"{base}.py", f"{base}/__init__.py") if tree.read(p) is not None), None)


def _bound_class(tree: Tree, module: str, name: str, hops: int) -> str:
    """``module.qualname`` of the class ``name`` is in ``module`` on CUDA: defined there, or imported."""
    path = _module_file(tree, module)
    if path is None:
        raise Missing(f"{module.replace('.', '/')}.py: not in the tree (named for {name})")
    binding = _cuda_binding(_parse(tree, path).body, name)
    if binding is None:
        raise Missing(f"{path}: binds no {name} on CUDA")
    if binding == "class":
        return f"{module}.{name}"
    source, original, level = binding
    if level:
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        for _ in range(level - 1):
            package = package.rpartition(".")[0]
        source = f"{package}.{source}" if source else package
    if hops == 0:
        raise Missing(f"{path}: {name} is imported through more than {_HOPS} modules")
    return _bound_class(tree, source, original, hops - 1)


def _on_cuda(test: ast.expr) -> bool | None:
    """Whether a platform test is true on CUDA (``current_platform.is_cuda()``); None for another test."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _on_cuda(test.operand)
        return None if inner is None else not inner
    if isinstance(test, ast.Call) and isinstance(test.func, ast.Attribute):
        if test.func.attr in ("is_cuda", "is_cuda_alike"):
            return True
        if test.func.attr in _OTHER_PLATFORMS:
            return False
    return None


def _cuda_binding(body: list[ast.stmt], name: str) -> str | tuple[str, str, int] | None:
    """What binds ``name`` last in ``body`` on CUDA: ``"class"`` (defined here) or (module, name, level)."""
    found: str | tuple[str, str, int] | None = None
    for node in body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            found = "class"
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    found = (node.module or "", alias.name, node.level)
        elif isinstance(node, ast.If):
            cuda = _on_cuda(node.test)
            branches = [node.body] if cuda else [node.orelse] if cuda is False else [node.body, node.orelse]
            for branch in branches:
                found = _cuda_binding(branch, name) or found
        elif isinstance(node, ast.Try):
            found = _cuda_binding(node.body, name) or found
    return found


def defines(tree: Tree, module: str, cls: str, method: str | None = None) -> str | None:
    """None when ``module`` defines class ``cls`` (with ``method``); else what is not there."""
    path = _module_file(tree, module)
    if path is None:
        return f"{module.replace('.', '/')}.py: not in the tree"
    found = _class(_parse(tree, path), cls)
    if found is None:
        return f"{path}: defines no class {cls}"
    if method and _method(found, method) is None:
        return f"{path}: {cls} defines no {method}"
    return None


def runner(tree: Tree, arch: str = ARCH) -> tuple[str, bool]:
    """(``arch``'s default model runner on CUDA, ``"v1"`` or ``"v2"``; whether ``VLLM_USE_V2_MODEL_RUNNER=0``
    still selects Model Runner V1)."""
    has_v1, has_v2 = tree.read(V1_RUNNER) is not None, tree.read(V2_RUNNER) is not None
    if not has_v1:
        if not has_v2:
            raise Missing(f"{V1_RUNNER}, {V2_RUNNER}: neither model runner is in the tree")
        return "v2", False  # Model Runner V1 removed
    selectable = f'"{RUNNER_ENV}"' in _text(tree, ENVS)
    config = _parse(tree, VLLM_CONFIG)
    cls = _class(config, "VllmConfig")
    prop = _method(cls, "use_v2_model_runner") if cls is not None else None
    if prop is None or not has_v2:
        return "v1", False  # no choice of runner
    for node in config.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == V2_ARCHITECTURES for t in targets):
                value = node.value
                if isinstance(value, ast.Call) and value.args:  # frozenset({...})
                    value = value.args[0]
                names = _literal(value)
                if not isinstance(names, set | list | tuple):
                    raise Missing(f"{VLLM_CONFIG}: {V2_ARCHITECTURES} is not a literal set")
                return ("v2" if arch in names else "v1"), selectable
    last = prop.body[-1]
    if isinstance(last, ast.Return) and isinstance(last.value, ast.Constant) and last.value.value is True:
        return "v2", selectable  # V2 for every model unless a feature it lacks is asked for
    raise Missing(f"{VLLM_CONFIG}: VllmConfig.use_v2_model_runner neither reads {V2_ARCHITECTURES} nor ends "
                  "in `return True`: the default runner cannot be read")


def dcp_defaults(tree: Tree, arch: str = ARCH) -> tuple[str, bool | None, bool]:
    """(the DCP comm backend, query replication (None: the release has no such option), whether ``arch``'s
    config hook chose them) that a GLM-5 user who sets neither gets."""
    parallel, fields = _parallel_config(tree)
    if "dcp_comm_backend" not in fields:
        raise Missing(f"{PARALLEL_CONFIG}: ParallelConfig has no dcp_comm_backend")
    backend = _literal(fields["dcp_comm_backend"])
    replicate = _literal(fields["dcp_q_replicate"]) if "dcp_q_replicate" in fields else None
    if backend is not None:
        return backend, replicate, False  # fixed defaults
    setter = _method(parallel, "set_dcp_defaults")
    if setter is None:
        raise Missing(f"{PARALLEL_CONFIG}: dcp_comm_backend defaults to None and ParallelConfig has no "
                      "set_dcp_defaults")
    params = [a.arg for a in setter.args.args[1:]]
    values = dict(zip(params[len(params) - len(setter.args.defaults):],
                      map(_literal, setter.args.defaults), strict=True))
    call = _hook_call(tree, arch)
    if call is not None:
        values.update(dict(zip(params, map(_literal, call.args), strict=False)))
        values.update({k.arg: _literal(k.value) for k in call.keywords if k.arg})
    if "comm_backend" not in values or "q_replicate" not in values:
        raise Missing(f"{PARALLEL_CONFIG}: set_dcp_defaults names no default comm_backend / q_replicate")
    return values["comm_backend"], values["q_replicate"], call is not None


def _parallel_config(tree: Tree) -> tuple[ast.ClassDef, dict[str, ast.expr | None]]:
    """``ParallelConfig``'s class and its fields (name -> default expression, None for none)."""
    parallel = _class(_parse(tree, PARALLEL_CONFIG), "ParallelConfig")
    if parallel is None:
        raise Missing(f"{PARALLEL_CONFIG}: no class ParallelConfig")
    return parallel, {n.target.id: n.value for n in parallel.body
                      if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def parallel_fields(tree: Tree) -> set[str]:
    """The names of ``ParallelConfig``'s fields (what a bench may set by name)."""
    return set(_parallel_config(tree)[1])


def _hook_call(tree: Tree, arch: str) -> ast.Call | None:
    """The ``set_dcp_defaults(...)`` call in ``arch``'s ``verify_and_update_config``, if it has one."""
    text = tree.read(MODEL_CONFIGS)
    if text is None:
        return None
    module = ast.parse(text)
    hook = None
    for node in ast.walk(module):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == arch and isinstance(value, ast.Name):
                    hook = _class(module, value.id)
    method = _method(hook, "verify_and_update_config") if hook is not None else None
    for node in ast.walk(method) if method is not None else ():
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "set_dcp_defaults":
            return node
    return None


def dcp_ops(tree: Tree) -> str:
    """The module path of the DCP ops (the combine, the direct workspaces)."""
    path = next((p for p in DCP_OPS if tree.read(p) is not None), None)
    if path is None:
        raise Missing(f"{' / '.join(DCP_OPS)}: neither is in the tree")
    return module_of(path)


def env_default(tree: Tree, name: str) -> bool | str | None:
    """The default of ``envs.py``'s ``name``: None (unset: the code decides), a bool or the string."""
    for node in ast.walk(_parse(tree, ENVS)):
        if not isinstance(node, ast.Dict):
            continue
        for key, value in zip(node.keys, node.values, strict=True):
            if isinstance(key, ast.Constant) and key.value == name:
                for call in ast.walk(value):
                    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                            and call.func.attr in ("getenv", "get") and call.args
                            and isinstance(call.args[0], ast.Constant) and call.args[0].value == name):
                        default = _literal(call.args[1]) if len(call.args) > 1 else None
                        return {"0": False, "1": True}.get(default, default) if isinstance(default, str) else default
                raise Missing(f"{ENVS}: {name} is not read with os.getenv")
    raise Missing(f"{ENVS}: no {name}")


def direct_a2a_switches(tree: Tree, ops_module: str) -> tuple[str, ...]:
    """The modules whose direct (symmetric-memory) path ``VLLM_USE_DIRECT_DCP_A2A`` switches: the DCP ops'
    A2A combine, and the indexer's direct top-k exchange where the release has one."""
    read = f"envs.{DIRECT_A2A_ENV}"
    found = [ops_module] if read in _text(tree, f"{ops_module.replace('.', '/')}.py") else []
    if tree.read(TOPK_DIRECT) is not None and read in (tree.read(INDEXER) or ""):
        found.append(module_of(TOPK_DIRECT))
    if not found:
        raise Missing(f"{DIRECT_A2A_ENV}: read by neither {ops_module} nor the indexer's direct top-k exchange")
    return tuple(found)


def manager_projects(tree: Tree) -> bool:
    """Whether the DCP ops' ``MLADCPManager.__init__`` sets ``self.v_up_proj_combine`` (the manager owns the
    combine that projects through W_UV; later releases) rather than having none (0.28.0's series adds
    ``project_combine`` instead)."""
    path = f"{dcp_ops(tree).replace('.', '/')}.py"
    cls = _class(_parse(tree, path), "MLADCPManager")
    if cls is None:
        raise Missing(f"{path}: no class MLADCPManager")
    init = _method(cls, "__init__")
    return init is not None and any(
        isinstance(n, ast.Attribute) and n.attr == "v_up_proj_combine" and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name) and n.value.id == "self" for n in ast.walk(init))


def projection_switch(tree: Tree) -> str | None:
    """How the build in ``tree`` is told whether to project through ``W_UV`` before the DCP merge:
    ``"argument"`` (``ParallelConfig.dcp_v_up_proj_before_merge``, the engine argument), ``"env"``
    (``envs.py`` reads ``VLLM_DCP_PROJECT_BEFORE_MERGE``), or None (no switch: the release's own policy)."""
    if PROJECTION_FIELD in parallel_fields(tree):
        return "argument"
    try:
        env_default(tree, PROJECTION_ENV)
    except Missing:
        return None
    return "env"
