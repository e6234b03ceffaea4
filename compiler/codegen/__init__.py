"""From imported Relax to code: the pipeline's ordered steps, the Hexagon path, linking, call sites."""
