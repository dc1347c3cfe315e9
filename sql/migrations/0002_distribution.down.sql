DROP TRIGGER IF EXISTS outbox_notify ON outbox;
DROP FUNCTION IF EXISTS outbox_notify();
DROP TABLE IF EXISTS data_planes;
DROP TABLE IF EXISTS config_version_regions;
DROP TABLE IF EXISTS config_versions;
DROP TABLE IF EXISTS regions;
