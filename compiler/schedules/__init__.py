"""Schedule rules per target family (dlight ScheduleRule lists)."""
