"""The settings sections of every component, in the foundation so that the settings tree composes them and every
layer imports them downward; each module is named after the package whose components read it."""
