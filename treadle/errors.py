"""Typed errors every layer may raise, so that the frontends route them by type, never by
parsing their text.

`InvalidField`: the client got one field of its request wrong. It is a ValueError (whatever
catches those still catches it) that names the field as the layer raising it knows it
(`param`): SamplingParams' and the engine's own names, which the REST and gRPC frontends send
as they are, but for the prompt, which each endpoint names itself (`prompt`, `messages`,
`input`). REST answers it with a 400 whose `param` is the field, gRPC with INVALID_ARGUMENT.

`UnsupportedSetting`: a valid setting this device or build cannot serve (the engine refuses to
start; the CLI exits with its message).
"""

from __future__ import annotations

PROMPT = "prompt"  # the core's name of a request's prompt (its token ids), whatever the API's


class InvalidField(ValueError):
    """A request field the client got wrong: `param` names it (None: no one field), the message
    says what is wrong."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param

    def renamed(self, names: dict[str, str]) -> InvalidField:
        """The same error, its field named as `names` maps the raiser's name to the caller's."""
        param = names.get(self.param, self.param) if self.param is not None else None
        return self if param == self.param else InvalidField(param, str(self))


class UnsupportedSetting(ValueError):
    """A setting's value that is valid but not served here (`setting` names it, the message
    says why and what to use instead)."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting
