"""Pictures: pipeline timelines (and later memory breakdowns), written as PNG or SVG."""
