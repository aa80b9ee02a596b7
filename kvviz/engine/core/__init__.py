"""The engine core: the one step driver every generation path runs its forwards through."""
