"""First-party platform plugins. Each subpackage registers itself through the
``core.platforms`` entry-point group, exactly as a third-party plugin would."""
