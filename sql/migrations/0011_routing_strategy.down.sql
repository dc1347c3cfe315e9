ALTER TABLE model_groups DROP COLUMN routing;
