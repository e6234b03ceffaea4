"""The artifact: its layout and checks, the atomic writer, and the native runtime it ships with."""
