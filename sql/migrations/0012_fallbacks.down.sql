ALTER TABLE data_planes DROP COLUMN ejected;
ALTER TABLE teams DROP COLUMN fallbacks;
ALTER TABLE keys DROP COLUMN fallbacks;
ALTER TABLE model_groups DROP COLUMN resilience;
ALTER TABLE model_groups DROP COLUMN fallbacks;
