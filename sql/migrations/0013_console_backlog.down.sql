ALTER TABLE data_planes DROP COLUMN admission_backlog;
