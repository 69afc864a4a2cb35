"""Host chunk pool and GPU <-> host transfer engine (placeholder until implemented)."""

__all__: list[str] = []
