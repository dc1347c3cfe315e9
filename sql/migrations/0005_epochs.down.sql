ALTER TABLE data_planes DROP COLUMN IF EXISTS rejecting;
DROP TABLE IF EXISTS distribution_epochs;
