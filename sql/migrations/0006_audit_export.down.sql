DROP TRIGGER audit_log_notify ON audit_log;
DROP FUNCTION audit_log_notify();
DROP TABLE audit_export;
