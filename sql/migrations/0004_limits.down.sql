DROP TABLE IF EXISTS budget_alerts;
DROP INDEX IF EXISTS spend_logs_customer_time_idx;
DROP INDEX IF EXISTS spend_logs_user_time_idx;
