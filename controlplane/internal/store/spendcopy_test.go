package store

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/internal/testsvc"
)

// TestSpendCopyMatchesPgx: SpendRecord's hand-encoded binary COPY writes
// every column of spend_logs exactly as pgx's own encoding of the same
// values does (the rows are compared column by column in Postgres), for
// logs with every field set, none set, tags, several tags, times before
// 2000 and with sub-microseconds, negative and extreme numbers.
func TestSpendCopyMatchesPgx(t *testing.T) {
	t.Parallel()
	pool, _ := testsvc.NewPool(t)
	ctx := context.Background()
	s := New(pool, nil)
	logs := []SpendLog{
		{RequestID: "req_full", At: time.Date(2026, 11, 3, 23, 59, 58, 123456789, time.UTC), Region: "eu", InstanceID: "dp-1",
			OrgID: "org_1", TeamID: "team_1", UserID: "user_1", KeyID: "key_1", Project: "proj", Customer: "acme",
			AgentID: "agent", SessionID: "sess", Tags: []string{"a", "b", "a", "ünï"}, TrafficClass: "batch",
			Route: "/v1/chat/completions", RequestedModel: "m", ModelGroup: "g", DeploymentID: "dep", Stream: true,
			PromptTokens: 1 << 40, CompletionTokens: 7, CachedTokens: 3, CacheCreationTokens: 2, CostUSD: 0.1 + 0.2,
			Status: 503, ErrorCode: "upstream_error", LatencyMS: 1234, TTFTMS: 56, Attempts: 3},
		{RequestID: "req_empty", At: time.Date(1999, 12, 31, 23, 59, 59, 999999, time.FixedZone("x", 3600))},
		{RequestID: "req_neg", At: time.Date(2000, 1, 1, 0, 0, 0, 1500, time.UTC), Tags: []string{"one"},
			PromptTokens: -1, CostUSD: -1e-300, Status: -2147483648, Attempts: 2147483647, LatencyMS: -9223372036854775808},
	}
	res, err := s.SpendRecord(ctx, logs)
	require.NoError(t, err)
	require.Equal(t, SpendRecordResult{Inserted: 3}, res)

	// The same logs through pgx's encoders, into a copy of the table.
	_, err = pool.Exec(ctx, `CREATE TABLE spend_logs_pgx (LIKE spend_logs INCLUDING DEFAULTS)`)
	require.NoError(t, err)
	rows := make([][]any, len(logs))
	for i, l := range logs {
		rows[i] = []any{l.RequestID, l.At.UTC(), l.Region, l.InstanceID, l.OrgID, l.TeamID, l.UserID, l.KeyID,
			l.Project, l.Customer, l.AgentID, l.SessionID, nonNil(l.Tags), l.TrafficClass, l.Route, l.RequestedModel,
			l.ModelGroup, l.DeploymentID, l.Stream, l.PromptTokens, l.CompletionTokens, l.CachedTokens, l.CacheCreationTokens, l.CostUSD,
			l.Status, l.ErrorCode, l.LatencyMS, l.TTFTMS, l.Attempts}
	}
	n, err := pool.CopyFrom(ctx, pgx.Identifier{"spend_logs_pgx"}, spendLogColumns, pgx.CopyFromRows(rows))
	require.NoError(t, err)
	require.EqualValues(t, len(logs), n)

	var same, total int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE a IS NOT DISTINCT FROM b), count(*)
		FROM (SELECT row_to_json(s)::jsonb a, row_to_json(p)::jsonb b FROM spend_logs s JOIN spend_logs_pgx p USING (request_id)) x`).Scan(&same, &total))
	require.Equal(t, len(logs), total)
	require.Equal(t, len(logs), same, "rows written by the binary COPY differ from pgx's")

	// And what the ledger reads back is what was recorded.
	got, err := s.SpendLogList(ctx, SpendLogQuery{}, 10)
	require.NoError(t, err)
	require.Len(t, got, 3)
	byID := map[string]SpendLog{}
	for _, l := range got {
		byID[l.RequestID] = l
	}
	full := byID["req_full"]
	require.Equal(t, time.Date(2026, 11, 3, 23, 59, 58, 123456000, time.UTC), full.At)
	require.Equal(t, []string{"a", "b", "a", "ünï"}, full.Tags)
	require.True(t, full.Stream)
	require.Equal(t, logs[0].CostUSD, full.CostUSD)
	require.Equal(t, int64(1<<40), full.PromptTokens)
	require.Equal(t, time.Date(1999, 12, 31, 22, 59, 59, 999000, time.UTC), byID["req_empty"].At)
	require.Empty(t, byID["req_empty"].Tags)
	require.Equal(t, int32(-2147483648), byID["req_neg"].Status)
}
