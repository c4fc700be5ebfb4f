"""Chat-template families: the boundary rules between a generated turn and the next messages.

Appended messages are tokenized from the chat template's rendering *diff* (see
:mod:`miles_core.session.tokenizer`); what happens right at the boundary -- between the last
token the model generated and the first token of the diff -- depends on the template family and
is declared here as data, then checked against the actual template when a tokenizer is loaded:

* ``assistant_close``: the text the template renders right after an assistant message's content.
  ChatML closes with ``<|im_end|>\\n``; a model stops on ``<|im_end|>``, so the ``\\n`` is part of
  the next observation.
* ``stop_token``: the generated token ``assistant_close`` starts with; when a completion does not
  end with it (a stop string matched instead), the whole close becomes observation.
* ``reopening_stops``: stop tokens that the next message opens with (GLM ends a turn by
  generating ``<|user|>`` or ``<|observation|>``). Such a trailing token is trimmed from the
  completion and the template's own opener is used, so the token sequence is what the template
  would render.
* ``append_roles``: roles that may be appended after a generated turn.

Add a family by adding a :class:`TemplateFamily` to :data:`FAMILIES`.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles_core.errors import ConfigError


@dataclass(frozen=True)
class TemplateFamily:
    name: str
    markers: tuple[str, ...]  # a template containing all of these belongs to the family
    assistant_close: str
    stop_token: str | None
    reopening_stops: tuple[str, ...] = ()
    append_roles: frozenset[str] = frozenset({"system", "user", "assistant", "tool"})

    def __post_init__(self) -> None:
        if self.stop_token is not None and not self.assistant_close.startswith(self.stop_token):
            raise ValueError(f"family {self.name}: assistant_close must start with stop_token")


CHATML = TemplateFamily(
    name="chatml",
    markers=("<|im_start|>", "<|im_end|>"),
    assistant_close="<|im_end|>\n",
    stop_token="<|im_end|>",
)

GLM4 = TemplateFamily(
    name="glm4",
    markers=("<|assistant|>", "<|observation|>"),
    assistant_close="",
    stop_token=None,
    reopening_stops=("<|user|>", "<|observation|>"),
    append_roles=frozenset({"system", "user", "tool"}),
)

FAMILIES: dict[str, TemplateFamily] = {f.name: f for f in (CHATML, GLM4)}


def family_named(name: str) -> TemplateFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ConfigError(f"unknown template family {name!r}; known: {', '.join(FAMILIES)}") from None


def detect_family(chat_template: str) -> TemplateFamily:
    """The one family whose markers all occur in ``chat_template``."""
    matches = [f.name for f in FAMILIES.values() if all(m in chat_template for m in f.markers)]
    if len(matches) != 1:
        found = f"matches {', '.join(matches)}" if matches else "matches none"
        raise ConfigError(
            f"the chat template {found} of the known template families ({', '.join(FAMILIES)}); "
            "name one explicitly (template_family / --template-family)"
        )
    return FAMILIES[matches[0]]
