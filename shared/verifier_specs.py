"""Verifier specs: how a task's completions are scored (DESIGN.md, "Verification layers").

A task carries ``verifier: {kind, params}`` (the flat form ``{kind, ...params}`` is the same spec):
``kind`` picks the deterministic layer (the ``correctness`` component), ``params`` its fields. An
optional ``recipe`` overrides the verifier service's recipe for the task's domain: which rules run,
whether a judge scores a rubric, which components gate the reward and how they are weighted.

Components are named ``correctness``, ``format``, ``tool_protocol``, ``safety``, ``truncation`` and
``judge``; each is a float in [0, 1] and every one computed is reported in ``Reward.components``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from shared.envs.loading import EnvironmentRef
from shared.jsoncheck import check_json, check_size

COMPONENTS = ("correctness", "format", "tool_protocol", "safety", "truncation", "judge")
"""Names a recipe may gate on or weight."""

EXTRACTIONS = Literal["last_number", "answer_tag", "boxed", "full"]

MAX_PATTERN_CHARS = 10_000
"""Longest regular expression accepted (characters). Compiling one this long takes at most ~60 ms
(measured with the ``regex`` package: literals, alternations, groups, nested repeats), so the
patterns of a request cost a bounded time; a 5 MB pattern took 26 s."""
MAX_PATTERNS_CHARS = 100_000
"""Most characters of all the ``extra_patterns`` of one safety rule together (~0.6 s to compile)."""
MAX_TEXT_CHARS = 1_000_000
"""Longest gold answer, reference or rubric-like text field of a spec (characters)."""
MAX_CODE_CHARS = 4 * 1024 * 1024
"""Longest test code or prefix (characters; the sandbox's own limit on a test's code)."""
MAX_SPEC_JSON_BYTES = 1024 * 1024
"""Largest free-form JSON value of a spec (``entry``, ``json_schema``, ``constraints``, a field's gold), as
compact JSON (bytes)."""
MAX_JSON_SCHEMA_BYTES = 64 * 1024
"""Largest ``json_schema`` of a format rule (bytes of compact JSON; compiling it is validation work)."""


def _check_regex(pattern: str) -> str:
    """``pattern`` unchanged when the ``regex`` package compiles it.

    Raises:
        ValueError: it is longer than :data:`MAX_PATTERN_CHARS` or does not compile, including patterns
            the compiler cannot handle at all (nested too deeply: RecursionError; the message names
            the pattern's start).
    """
    import regex

    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"regular expression of {len(pattern)} characters is longer than {MAX_PATTERN_CHARS}")
    try:
        regex.compile(pattern)
    except regex.error as e:
        raise ValueError(f"invalid regular expression {pattern[:100]!r}: {e}") from None
    except (RecursionError, OverflowError, MemoryError, ValueError, TypeError) as e:
        raise ValueError(f"regular expression {pattern[:100]!r} cannot be compiled: {type(e).__name__}") from None
    return pattern


# ---------------------------------------------------------------- rules layer


class FormatRule(BaseModel):
    """Output format. 1 when every requested check holds, else 0 (the failures are in the details).

    A reasoning block opened with ``<think>`` and never closed always fails, requested or not.
    """

    model_config = ConfigDict(extra="forbid")
    rule: Literal["format"] = "format"
    think: Literal["optional", "required"] = "optional"
    """``required``: the response must open with a closed ``<think>…</think>`` block."""
    answer_tag: bool = False
    """The response must hold a non-empty ``<answer>…</answer>`` after any reasoning block."""
    json_schema: dict[str, Any] | None = None
    """The answer (tag content when ``answer_tag``, else the first JSON object in the response)
    must parse as JSON and validate against this JSON Schema (draft 2020-12)."""

    @field_validator("json_schema")
    @classmethod
    def _valid_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            import jsonschema

            check_json(v)
            check_size(v, MAX_JSON_SCHEMA_BYTES, "json_schema")
            try:
                jsonschema.Draft202012Validator.check_schema(v)
                for probe in (None, {}, [], "", 0):  # reach every $ref: one that cannot resolve fails here
                    list(jsonschema.Draft202012Validator(v).iter_errors(probe))
            except jsonschema.SchemaError as e:
                raise ValueError(f"not a valid JSON Schema: {e.message}") from e
            except Exception as e:  # noqa: BLE001 - unresolvable $ref, RecursionError and the like
                raise ValueError(f"JSON Schema cannot be applied: {type(e).__name__}: {str(e)[:200]}") from None
        return v


class ToolProtocolRule(BaseModel):
    """Tool calls (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, see ``shared.tools``)
    must be valid JSON objects with object arguments and name only allowed tools."""

    model_config = ConfigDict(extra="forbid")
    rule: Literal["tool_protocol"] = "tool_protocol"
    allowed_tools: list[Annotated[str, Field(min_length=1, max_length=128)]] | None = Field(None, max_length=256)
    """Allowed tool names; ``None`` = the task's ``tools``."""
    require_call: bool = False
    """At least one tool call must be present."""


class SafetyRule(BaseModel):
    """No destructive actions (``rm -rf /``, ``mkfs``, fork bombs, ``curl | sh``, ``DROP TABLE``…) in the
    agent's actions: tool-call arguments and shell/Python code blocks (plus ``extra_patterns``)."""

    model_config = ConfigDict(extra="forbid")
    rule: Literal["safety"] = "safety"
    extra_patterns: list[str] = Field(default_factory=list, max_length=256)
    """More regular expressions (case-insensitive) that count as destructive."""
    scan_text: bool = False
    """Scan the whole response, not only actions (tool arguments and code blocks)."""

    @field_validator("extra_patterns")
    @classmethod
    def _compiles(cls, v: list[str]) -> list[str]:
        total = sum(len(p) for p in v)
        if total > MAX_PATTERNS_CHARS:
            raise ValueError(f"the patterns hold {total} characters together, more than {MAX_PATTERNS_CHARS}")
        for i, p in enumerate(v):
            try:
                _check_regex(p)
            except ValueError as e:
                raise ValueError(f"pattern {i}: {e}") from None
        return v


class TruncationRule(BaseModel):
    """0 when generation hit its token budget (finish_reason ``length``), else 1."""

    model_config = ConfigDict(extra="forbid")
    rule: Literal["truncation"] = "truncation"


RuleSpec = Annotated[Union[FormatRule, ToolProtocolRule, SafetyRule, TruncationRule], Field(discriminator="rule")]


# ---------------------------------------------------------------- judge layer and recipe


class JudgeRubric(BaseModel):
    """A rubric scored by the judge model (``verifier.judge`` in the service config says which)."""

    model_config = ConfigDict(extra="forbid")
    rubric: str = Field(min_length=1, max_length=20_000)
    """What a good response does; shown to the judge with the task and the response."""
    scale_min: int = Field(0, ge=-100, le=99)
    scale_max: int = Field(10, ge=1, le=100)
    """The judge answers an integer in [scale_min, scale_max]; the component is its linear map to [0, 1]."""
    reference: str | None = Field(None, max_length=MAX_TEXT_CHARS)
    """A reference answer shown to the judge."""

    @model_validator(mode="after")
    def _range(self) -> "JudgeRubric":
        if self.scale_min >= self.scale_max:
            raise ValueError("scale_min must be below scale_max")
        return self


def safe_default_recipe() -> "Recipe":
    """The verifier's recipe for a task that names none (from REST, a YAML, a generator or an environment):
    correctness, a completion cut off at its token budget earns 0 (the truncation gate: a right answer that was
    still going is not full credit), and a detected reward hack earns 0 (``hack_policy: zero``)."""
    return Recipe(rules=[TruncationRule()], gates=["truncation"])


NO_TRUNCATION_GATE = "no truncation gate"
"""The start of every shipped opt-out's ``reason``."""


class Recipe(BaseModel):
    """How the layers compose into ``Reward.total``.

    ``total = 0`` when any gate component is below 1 (the gate failed), else
    ``Σ_c w_c · component_c / Σ_c w_c`` over the weighted components that were computed.
    A detected reward hack (``verifier_service.hacks``: hedging, test tampering, instructions to the
    judge, degenerate repetition) is flagged in the details and counted, and under the default
    ``hack_policy: zero`` sets the total to 0; ``flag`` only reports it. Instructions to the judge
    zero only a recipe with a ``judge`` (elsewhere no grader reads them: they are only flagged).
    """

    model_config = ConfigDict(extra="forbid")
    rules: list[RuleSpec] = Field(default_factory=list, max_length=16)
    judge: JudgeRubric | None = None
    gates: list[Annotated[str, Field(max_length=64)]] = Field(default_factory=list, max_length=16)
    """Components that must be exactly 1 (e.g. ``format``, ``safety``)."""
    weights: dict[Annotated[str, Field(max_length=64)], float] = Field(
        default_factory=lambda: {"correctness": 1.0}, max_length=16)
    """Weight per component (≥ 0, at least one > 0)."""
    hack_policy: Literal["flag", "zero"] = "zero"
    """``zero``: a detected reward hack makes the total 0; ``flag``: it is only reported and counted."""
    reason: str | None = Field(None, max_length=2000)
    """Why this recipe leaves out a safe default (the truncation gate, ``hack_policy: zero``): the verifier's
    default recipe gates truncation, so a task opts out only with a recipe of its own, which says why here."""

    @property
    def opts_out(self) -> bool:
        """Whether this recipe only opts out of the safe default: a ``reason`` and nothing else set. Such a
        task's domain recipe in the verifier service still applies; without one, correctness alone."""
        return self.reason is not None and self.model_dump(exclude={"reason"}) == Recipe().model_dump(exclude={"reason"})

    @model_validator(mode="after")
    def _consistent(self) -> "Recipe":
        named = set(self.gates) | set(self.weights)
        unknown = sorted(named - set(COMPONENTS))
        if unknown:
            raise ValueError(f"unknown component(s) {unknown}; known: {list(COMPONENTS)}")
        present = {"correctness"} | {r.rule for r in self.rules} | ({"judge"} if self.judge else set())
        missing = sorted(named - present)
        if missing:
            raise ValueError(f"component(s) {missing} are gated or weighted but no rule or judge computes them")
        if any(not 0 <= w <= 1e6 for w in self.weights.values()) or not any(w > 0 for w in self.weights.values()):
            raise ValueError("weights must be between 0 and 1e6 with at least one > 0")
        return self


# ---------------------------------------------------------------- deterministic kinds


def _kind_required(schema: dict[str, Any]) -> None:
    """JSON Schema hook of the specs: ``kind`` is required (it is the discriminator of
    :data:`VerifierSpec`; the model's default only serves code that builds one spec type directly)."""
    req = schema.setdefault("required", [])
    if "kind" not in req:
        req.insert(0, "kind")


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_kind_required)
    recipe: Recipe | None = None
    """Per-task recipe; ``None`` = the verifier service's recipe for the task's domain."""


class ReasoningGymSpec(_Spec):
    """Score with a reasoning-gym dataset's own scorer; reward 1 only when it returns exactly 1.0.

    ``entry`` is the dataset item (question, answer, metadata) the scorer needs.
    """

    kind: Literal["reasoning_gym"] = "reasoning_gym"
    dataset: str = Field(min_length=1, max_length=128)
    entry: dict[str, Any]
    extract: EXTRACTIONS = "last_number"
    """How the answer is taken from the completion before scoring (strict; no partial credit)."""

    @field_validator("entry")
    @classmethod
    def _storable(cls, v: dict[str, Any]) -> dict[str, Any]:
        check_json(v)
        check_size(v, MAX_SPEC_JSON_BYTES, "entry")
        if not isinstance(v.get("answer"), str):
            raise ValueError("entry needs 'answer', the dataset's gold answer as a string")
        return v

    @field_validator("dataset")
    @classmethod
    def _known(cls, v: str) -> str:
        from reasoning_gym.factory import DATASETS

        if v not in DATASETS:
            raise ValueError(f"unknown reasoning-gym dataset {v!r}")
        return v


class MathSpec(_Spec):
    """Math answer equivalence with math-verify (run in a process pool with our own time bound).

    The gold is read whole, once: a plain gold (no ``$``, ``\\(``, ``\\[``, ``\\boxed``) as one
    expression (``(1, 2)`` is a tuple, not 2), a delimited one the way math-verify reads an answer.
    A gold that does not parse, or parses to only part of itself, is a misconfigured task
    (``infra_error`` with ``details.misconfigured``), never a 0 for the model. The options below are
    math-verify's own (``parse``'s extraction configs, ``verify``'s keyword arguments); the defaults
    are those of math-verify's test-suite helper and keep the behaviour of tasks written without them.
    """

    kind: Literal["math"] = "math"
    answer: str = Field(max_length=10_000)
    """Gold answer (LaTeX or plain; at most 10,000 characters: parsing it with math-verify is validation
    work whose time grows with its length)."""
    extraction: list[Literal["latex", "expr"]] = Field(default_factory=lambda: ["latex", "expr"], min_length=1,
                                                       max_length=2)
    """math-verify extraction targets for the model answer: ``latex`` (``LatexExtractionConfig``: ``$…$``,
    ``\\(…\\)``, ``\\[…\\]``, ``\\boxed{}``; also plain-text math such as ``2pi`` or ``3*sqrt(2)``, which we
    rewrite as LaTeX) and ``expr`` (``ExprExtractionConfig``: plain numbers and fractions; also our
    word-bounded last-number fallback). ``["latex"]`` alone ignores numbers written outside LaTeX."""
    boxed_match_priority: int = Field(0, ge=-1, le=1000)
    """``LatexExtractionConfig.boxed_match_priority``: 0 reads ``\\boxed{}`` before any other LaTeX (a
    "final answer is $x$. I hope" sentence, same priority, still wins when it comes last); math-verify's
    own default is 50; -1 never reads boxes (nor does our box fallback)."""
    float_rounding: int = Field(6, ge=0, le=20)
    """``verify(float_rounding=…)``: decimal places floats are rounded to before comparing."""
    numeric_precision: int = Field(15, ge=1, le=100)
    """``verify(numeric_precision=…)``: significant digits of numeric evaluation (``evalf``)."""
    strict: bool = True
    """``verify(strict=…)``: False lets variables differ (``f(x)`` equals ``f(y)``) and relaxes other
    structural checks."""
    allow_set_relation_comp: bool = False
    """``verify(allow_set_relation_comp=…)``: True lets a gold set or interval (``x \\in [-2, 7]``) match an
    answer written as relations (``-2 \\le x \\le 7``); the reverse direction is always allowed."""

    @field_validator("extraction")
    @classmethod
    def _distinct_targets(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"extraction targets repeat: {v}")
        return v


class NamedTest(BaseModel):
    """One test of a ``unit_tests`` spec: code run against the solution (see the sandbox's TestCase)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)
    code: str = Field(min_length=1, max_length=MAX_CODE_CHARS)


class UnitTestsSpec(_Spec):
    """Run the completion's code (appended to ``prefix``) against ``tests`` in the sandbox's test-harness
    mode; per-test results come back in the details. Reward 1 when all pass (with ``partial_credit``:
    the fraction that pass).

    Human-eval: ``prefix`` is the problem prompt, ``tests`` its ``test`` code (one test, which calls
    ``check(entry_point)``), ``entry_point`` the function.
    """

    kind: Literal["unit_tests"] = "unit_tests"
    tests: Annotated[str, Field(min_length=1, max_length=MAX_CODE_CHARS)] | Annotated[
        list[NamedTest], Field(min_length=1, max_length=1000)]
    """One test's code, or several named tests (each reported on its own)."""
    partial_credit: bool = False
    entry_point: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    prefix: str = Field("", max_length=MAX_CODE_CHARS)
    language: Literal["python"] = "python"
    timeout_s: float | None = Field(None, gt=0, le=300)


class ExactSpec(_Spec):
    """Reward 1 when the stripped completion (or its extracted answer) equals ``answer``."""

    kind: Literal["exact"] = "exact"
    answer: str = Field(max_length=MAX_TEXT_CHARS)
    case_sensitive: bool = True
    extract: EXTRACTIONS = "full"


class RegexSpec(_Spec):
    """Reward 1 when ``pattern`` matches the completion (``search`` of the ``regex`` package, a superset
    of ``re``; anchor it with ``^`` for a prefix). The match runs under a timeout
    (``verifier.regex_timeout_s``), so a pattern that backtracks catastrophically cannot stall the verifier."""

    kind: Literal["regex"] = "regex"
    pattern: str = Field(max_length=MAX_PATTERN_CHARS)

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        return _check_regex(v)


class NumericSpec(_Spec):
    """Reward 1 when the extracted number is within tolerance of ``answer``:
    ``|x − a| ≤ max(abs_tol, rel_tol · |a|)`` (``math.isclose``'s rule).

    Units, currency signs, thousands separators and a trailing ``%`` are stripped; ``3/4`` and
    ``1.5e3`` parse; ``(1,234)`` is −1234 (accounting).
    """

    kind: Literal["numeric"] = "numeric"
    answer: float = Field(allow_inf_nan=False)
    abs_tol: float = Field(1e-6, ge=0, allow_inf_nan=False)
    rel_tol: float = Field(1e-6, ge=0, allow_inf_nan=False)
    extract: EXTRACTIONS = "last_number"
    """``last_number`` takes the last number in the text; other modes take a span, then its number."""

    @field_validator("answer", mode="before")
    @classmethod
    def _not_bool(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError("answer must be a number, not a boolean")
        return v


class FieldSpec(BaseModel):
    """One expected field of a ``json_fields`` answer."""

    model_config = ConfigDict(extra="forbid")
    value: Any
    """Gold value."""
    type: Literal["string", "number", "amount", "date", "bool", "exact"] = "string"
    """How both sides are normalised: ``string`` case/whitespace-folded; ``number``/``amount`` parsed with
    units, currency, scale words (thousand, million, bn…) and accounting negatives; ``date`` to ISO
    YYYY-MM-DD from common formats; ``exact`` compared as JSON values."""
    weight: float = Field(1.0, gt=0, le=1e6, allow_inf_nan=False)
    abs_tol: float = Field(0.0, ge=0, allow_inf_nan=False)
    rel_tol: float = Field(1e-9, ge=0, allow_inf_nan=False)
    day_first: bool = False
    """``date``: read ``03/04/2024`` as 3 April."""

    @model_validator(mode="before")
    @classmethod
    def _infer_type(cls, data: Any) -> Any:
        """A gold given as a number (or boolean) without a ``type`` is compared as one, not as text."""
        if isinstance(data, dict) and "type" not in data:
            v = data.get("value")
            if isinstance(v, bool):
                data = {**data, "type": "bool"}
            elif isinstance(v, (int, float)):
                data = {**data, "type": "number"}
        return data

    @model_validator(mode="after")
    def _gold_is_readable(self) -> "FieldSpec":
        from shared.text import normalise_date, parse_number

        check_json(self.value)
        check_size(self.value, MAX_SPEC_JSON_BYTES, "value")
        amount = self.type == "amount"
        if self.type in ("number", "amount") and parse_number(self.value, amount, single=True, accounting=amount) is None:
            raise ValueError(f"gold {self.value!r} is not a single number, so no answer could match it")
        if self.type == "date" and normalise_date(self.value, self.day_first) is None:
            raise ValueError(f"gold {self.value!r} is not a valid date, so no answer could match it")
        if self.type == "bool" and not (isinstance(self.value, bool)
                                        or str(self.value).strip().lower() in ("true", "false", "yes", "no")):
            raise ValueError(f"gold {self.value!r} is not a boolean")
        return self


_FIELD_SETTINGS = set(FieldSpec.model_fields) - {"value"}


class JsonFieldsSpec(_Spec):
    """Structured extraction: the response's JSON object (``<answer>`` content, a fenced ```json block
    or the first balanced ``{…}``) is compared field by field; score = weighted fraction of fields right.

    Field names may be dotted paths into nested objects (``balance_sheet.total_assets``).
    """

    kind: Literal["json_fields"] = "json_fields"
    fields: dict[Annotated[str, Field(min_length=1, max_length=512)], FieldSpec] = Field(min_length=1,
                                                                                          max_length=1000)

    @field_validator("fields", mode="before")
    @classmethod
    def _bare_values(cls, v: Any) -> Any:
        """A bare gold is its own ``value`` (``{"revenue": 12.5}`` is ``{"revenue": {"value": 12.5}}``).

        Raises:
            ValueError: an object with FieldSpec settings (``type``, ``weight``...) but no ``value``: the
                gold is missing (it used to become the gold itself, an object no answer matches). A gold
                that is itself such an object is written ``{"value": {...}}``.
        """
        if isinstance(v, dict):
            out = {}
            for k, f in v.items():
                if isinstance(f, dict) and "value" not in f and set(f) & _FIELD_SETTINGS:
                    raise ValueError(f"field {str(k)[:100]!r}: 'value' (the gold) is required beside "
                                     f"{sorted(set(f) & _FIELD_SETTINGS)}")
                out[k] = f if isinstance(f, dict) and "value" in f else {"value": f}
            return out
        return v


class GeometrySpec(_Spec):
    """A scene of primitives checked against constraints (``verifier_service.geometry`` defines both).

    Score = weighted fraction of constraints met (``all_or_nothing``: 1 only when all are met).
    """

    kind: Literal["geometry"] = "geometry"
    constraints: list[dict[str, Any]] = Field(min_length=1, max_length=256)
    all_or_nothing: bool = False
    tolerance: float = Field(1e-3, ge=0, le=1.0)
    """Length tolerance (scene units) of contact, containment and overlap checks."""

    @field_validator("constraints")
    @classmethod
    def _known(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from shared.scene import validate_constraint

        check_json(v)
        check_size(v, MAX_SPEC_JSON_BYTES, "constraints")
        for i, c in enumerate(v):
            try:
                validate_constraint(c)
            except ValueError as e:
                raise ValueError(f"constraint {i}: {e}") from e
        return v


class EnvironmentSpec(_Spec):
    """Score with a user environment's rubric (:mod:`shared.envs`, docs/guides/environments.md): the verifier
    loads the environment ``environment`` names and calls its reward functions with the completion, the prompt,
    ``answer``, ``info`` and ``row``. Their weighted mean is the ``correctness`` component; a reward that
    raises, times out (``verifier.reward_timeout_s``) or returns a non-number is an infrastructure error,
    never a 0."""

    kind: Literal["environment"] = "environment"
    environment: EnvironmentRef
    answer: Any = None
    """The dataset row's answer (any JSON value)."""
    info: dict[str, Any] = Field(default_factory=dict)
    """The row's ``info``."""
    row: dict[str, Any] = Field(default_factory=dict)
    """The rest of the dataset row (the reward's ``task`` argument, with ``prompt``, ``answer`` and ``info``)."""

    @field_validator("answer", "info", "row")
    @classmethod
    def _storable(cls, v: Any, info) -> Any:
        check_json(v)
        check_size(v, MAX_SPEC_JSON_BYTES, info.field_name)
        return v

    @property
    def task(self) -> dict[str, Any]:
        """The row as the environment's hooks and rewards get it (their ``task`` argument)."""
        return {**self.row, "answer": self.answer, "info": self.info}


def _flatten_params(v: Any) -> Any:
    """``{kind, params: {...}, recipe?}`` → ``{kind, ...params, recipe?}`` (both forms are accepted)."""
    if isinstance(v, dict) and "params" in v:
        params = v["params"]
        if not isinstance(params, dict):
            raise ValueError("params must be an object")
        clash = sorted(set(params) & (set(v) - {"params"}))
        if clash:
            raise ValueError(f"field(s) {clash} given both in params and beside it")
        return {**{k: x for k, x in v.items() if k != "params"}, **params}
    return v


VerifierSpec = Annotated[
    Union[ReasoningGymSpec, MathSpec, UnitTestsSpec, ExactSpec, RegexSpec, NumericSpec, JsonFieldsSpec,
          GeometrySpec, EnvironmentSpec],
    Field(discriminator="kind"),
    BeforeValidator(_flatten_params),
]
