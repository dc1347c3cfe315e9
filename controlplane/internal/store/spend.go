package store

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
)

// Spend scopes: the scope column of spend_daily (SPEC §9.2).
const (
	SpendScopeOrg        = "org"
	SpendScopeTeam       = "team"
	SpendScopeUser       = "user"
	SpendScopeKey        = "key"
	SpendScopeCustomer   = "customer"
	SpendScopeModelGroup = "model_group"
	SpendScopeDeployment = "deployment"
	SpendScopeTag        = "tag"
	// SpendScopeProject rows exist from migration 0013 on (which
	// backfilled the days recorded before it).
	SpendScopeProject = "project"
)

// SpendLog is one request in the usage ledger.
type SpendLog struct {
	RequestID        string
	At               time.Time
	Region           string
	InstanceID       string
	OrgID            string
	TeamID           string
	UserID           string
	KeyID            string
	Project          string
	Customer         string
	AgentID          string
	SessionID        string
	Tags             []string
	TrafficClass     string
	Route            string
	RequestedModel   string
	ModelGroup       string
	DeploymentID     string
	Stream           bool
	PromptTokens     int64
	CompletionTokens int64
	CachedTokens     int64
	// CacheCreationTokens are prompt-cache writes, counted in PromptTokens too.
	CacheCreationTokens int64
	CostUSD             float64
	Status              int32
	ErrorCode           string
	LatencyMS           int64
	TTFTMS              int64
	Attempts            int32
}

// SpendTotals are summed amounts.
type SpendTotals struct {
	Requests         int64
	PromptTokens     int64
	CompletionTokens int64
	CachedTokens     int64
	CostUSD          float64
}

func (t *SpendTotals) add(l *SpendLog) {
	t.Requests++
	t.PromptTokens += l.PromptTokens
	t.CompletionTokens += l.CompletionTokens
	t.CachedTokens += l.CachedTokens
	t.CostUSD += l.CostUSD
}

// SpendRecordResult says what SpendRecord did.
type SpendRecordResult struct {
	// Inserted counts new spend_logs rows; Duplicates counts logs whose
	// request id was already recorded (redeliveries), which changed nothing.
	Inserted, Duplicates int
}

// spendKey is one spend_daily row.
type spendKey struct {
	scope, scopeID, orgID string
	day                   time.Time
}

func (k spendKey) compare(o spendKey) int {
	if c := strings.Compare(k.scope, o.scope); c != 0 {
		return c
	}
	if c := strings.Compare(k.scopeID, o.scopeID); c != 0 {
		return c
	}
	if c := strings.Compare(k.orgID, o.orgID); c != 0 {
		return c
	}
	return k.day.Compare(o.day)
}

// appendSpendScopes appends the (scope, id) pairs l counts towards; empty
// ids are skipped, and each tag counts once even if repeated.
func appendSpendScopes(out [][2]string, l *SpendLog) [][2]string {
	for _, s := range [...][2]string{
		{SpendScopeOrg, l.OrgID}, {SpendScopeTeam, l.TeamID}, {SpendScopeUser, l.UserID},
		{SpendScopeKey, l.KeyID}, {SpendScopeCustomer, l.Customer}, {SpendScopeModelGroup, l.ModelGroup},
		{SpendScopeDeployment, l.DeploymentID}, {SpendScopeProject, l.Project},
	} {
		if s[1] != "" {
			out = append(out, s)
		}
	}
	for i, t := range l.Tags {
		if t != "" && !slices.Contains(l.Tags[:i], t) {
			out = append(out, [2]string{SpendScopeTag, t})
		}
	}
	return out
}

// utcDay is the UTC day of t, as midnight UTC.
func utcDay(t time.Time) time.Time {
	y, m, d := t.UTC().Date()
	return time.Date(y, m, d, 0, 0, 0, 0, time.UTC)
}

func pgDate(t time.Time) pgtype.Date { return pgtype.Date{Time: utcDay(t), Valid: true} }

// spendLogColumns are the spend_logs columns SpendRecord writes.
var spendLogColumns = []string{"request_id", "at", "region", "instance_id", "org_id", "team_id", "user_id", "key_id",
	"project", "customer", "agent_id", "session_id", "tags", "traffic_class", "route", "requested_model",
	"model_group", "deployment_id", "stream", "prompt_tokens", "completion_tokens", "cached_tokens",
	"cache_creation_tokens", "cost_usd",
	"status", "error_code", "latency_ms", "ttft_ms", "attempts"}

// spendIncomingDDL creates SpendRecord's staging table once per session
// (a no-op, with a notice, afterwards); ON COMMIT DELETE ROWS empties it
// at every commit, and a rollback discards its rows anyway.
const spendIncomingDDL = `CREATE TEMP TABLE IF NOT EXISTS spend_logs_incoming (LIKE spend_logs INCLUDING DEFAULTS) ON COMMIT DELETE ROWS`

// spendIncomingCopy stages the logs (appendSpendCopy's binary tuples).
var spendIncomingCopy = `COPY spend_logs_incoming (` + strings.Join(spendLogColumns, ", ") + `) FROM STDIN (FORMAT binary)`

// spendIncomingInsert moves the staged logs into spend_logs, in request-id
// order, skipping request ids already recorded, and returns the ids it
// inserted (as text: the query is sent with the text result format).
var spendIncomingInsert = `INSERT INTO spend_logs (` + strings.Join(spendLogColumns, ", ") + `)
SELECT ` + strings.Join(spendLogColumns, ", ") + ` FROM spend_logs_incoming ORDER BY request_id
ON CONFLICT (request_id) DO NOTHING
RETURNING request_id`

// SpendRecord records logs in one transaction: each log is inserted into
// spend_logs unless its request id is already there, and only the logs
// actually inserted are added to the daily aggregates of every scope they
// belong to. Recording the same log twice therefore changes nothing the
// second time, which makes redelivery of usage events safe. On error
// nothing is recorded.
func (s *Store) SpendRecord(ctx context.Context, logs []SpendLog) (SpendRecordResult, error) {
	var res SpendRecordResult
	if len(logs) == 0 {
		return res, nil
	}
	// Insert in request-id order: concurrent consumers that got the same
	// redelivered events then wait on each other instead of deadlocking.
	// The sort is stable and only the first log of a request id is
	// offered, so when one call repeats a request id (a batch carrying
	// it twice) the first recorded wins, as across calls.
	sorted := make([]*SpendLog, len(logs))
	for i := range logs {
		sorted[i] = &logs[i]
	}
	slices.SortStableFunc(sorted, func(a, b *SpendLog) int { return strings.Compare(a.RequestID, b.RequestID) })
	offered := make([]bool, len(sorted))
	buf := make([]byte, 0, len(copyBinaryHeader)+2+len(sorted)*320)
	buf = append(buf, copyBinaryHeader...)
	for i, l := range sorted {
		if i > 0 && l.RequestID == sorted[i-1].RequestID {
			continue
		}
		offered[i] = true
		buf = appendSpendCopy(buf, l)
	}
	buf = append(buf, 0xff, 0xff) // trailer
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		// The logs are copied (COPY, binary, encoded by appendSpendCopy)
		// into a per-session temporary table emptied at commit, then
		// inserted in one statement: per row this costs a fraction of one
		// pipelined INSERT, on both sides.
		if _, err := tx.Exec(ctx, spendIncomingDDL); err != nil {
			return fmt.Errorf("spend logs staging table: %w", err)
		}
		if _, err := tx.Conn().PgConn().CopyFrom(ctx, bytes.NewReader(buf), spendIncomingCopy); err != nil {
			return fmt.Errorf("copy spend logs: %w", err)
		}
		// The ids inserted, read raw and looked up in sorted.
		inserted := make([]bool, len(sorted))
		ids, err := tx.Query(ctx, spendIncomingInsert)
		if err != nil {
			return fmt.Errorf("insert spend logs: %w", err)
		}
		for ids.Next() {
			id := string(ids.RawValues()[0])
			i, found := slices.BinarySearchFunc(sorted, id, func(l *SpendLog, id string) int { return strings.Compare(l.RequestID, id) })
			for ; found && i < len(sorted) && sorted[i].RequestID == id; i++ {
				inserted[i] = offered[i]
			}
		}
		if err := ids.Err(); err != nil {
			return fmt.Errorf("insert spend logs: %w", err)
		}
		sums := map[spendKey]*SpendTotals{}
		res = SpendRecordResult{}
		var scopes [][2]string
		for i, l := range sorted {
			if !inserted[i] {
				res.Duplicates++
				continue
			}
			res.Inserted++
			day := utcDay(l.At)
			scopes = appendSpendScopes(scopes[:0], l)
			for _, sc := range scopes {
				k := spendKey{scope: sc[0], scopeID: sc[1], orgID: l.OrgID, day: day}
				t := sums[k]
				if t == nil {
					t = &SpendTotals{}
					sums[k] = t
				}
				t.add(l)
			}
		}
		if len(sums) == 0 {
			return nil
		}
		keys := make([]spendKey, 0, len(sums))
		for k := range sums {
			keys = append(keys, k)
		}
		slices.SortFunc(keys, spendKey.compare)
		p := dbsqlc.SpendDailyAddParams{}
		for _, k := range keys {
			t := sums[k]
			p.Days = append(p.Days, pgDate(k.day))
			p.Scopes = append(p.Scopes, k.scope)
			p.ScopeIds = append(p.ScopeIds, k.scopeID)
			p.OrgIds = append(p.OrgIds, k.orgID)
			p.Requests = append(p.Requests, t.Requests)
			p.PromptTokens = append(p.PromptTokens, t.PromptTokens)
			p.CompletionTokens = append(p.CompletionTokens, t.CompletionTokens)
			p.CachedTokens = append(p.CachedTokens, t.CachedTokens)
			p.Costs = append(p.Costs, t.CostUSD)
		}
		if err := s.q.SpendDailyAdd(ctx, tx, p); err != nil {
			return fmt.Errorf("add daily spend: %w", err)
		}
		return nil
	})
	if err != nil {
		return SpendRecordResult{}, fmt.Errorf("record spend: %w", err)
	}
	return res, nil
}

// SpendSumQuery selects what SpendSum adds up.
type SpendSumQuery struct {
	Scope   string
	ScopeID string
	// OrgID restricts the sum to one org's spend ("" for every org).
	OrgID string
	// Start and End are UTC midnights: the days [Start, End) are summed.
	Start, End time.Time
}

// SpendSum sums the daily aggregates of one scope.
func (s *Store) SpendSum(ctx context.Context, q SpendSumQuery) (SpendTotals, error) {
	r, err := s.q.SpendDailySum(ctx, s.pool, dbsqlc.SpendDailySumParams{
		Scope: q.Scope, ScopeID: q.ScopeID, OrgID: optStr(q.OrgID), StartDay: pgDate(q.Start), EndDay: pgDate(q.End),
	})
	if err != nil {
		return SpendTotals{}, fmt.Errorf("sum spend of %s %s: %w", q.Scope, q.ScopeID, err)
	}
	return SpendTotals{Requests: r.Requests, PromptTokens: r.PromptTokens, CompletionTokens: r.CompletionTokens,
		CachedTokens: r.CachedTokens, CostUSD: r.CostUsd}, nil
}

// SpendLogQuery filters SpendLogList; empty fields mean "any".
type SpendLogQuery struct {
	Tenant
	UserID     string
	KeyID      string
	ModelGroup string
	Start, End *time.Time
	// After is the keyset cursor: the (At, RequestID) of the last log of
	// the previous page (zero At: first page).
	AfterAt time.Time
	AfterID string
}

// SpendLogList returns up to limit logs matching q, newest first.
func (s *Store) SpendLogList(ctx context.Context, q SpendLogQuery, limit int) ([]SpendLog, error) {
	p := dbsqlc.SpendLogListParams{
		OrgID: optStr(q.OrgID), TeamID: optStr(q.TeamID), UserID: optStr(q.UserID), KeyID: optStr(q.KeyID),
		ModelGroup: optStr(q.ModelGroup), StartAt: q.Start, EndAt: q.End, AfterID: q.AfterID, Lim: int32(limit),
	}
	if !q.AfterAt.IsZero() {
		at := q.AfterAt
		p.AfterAt = &at
	}
	rows, err := s.q.SpendLogList(ctx, s.pool, p)
	if err != nil {
		return nil, fmt.Errorf("list spend logs: %w", err)
	}
	out := make([]SpendLog, len(rows))
	for i, r := range rows {
		out[i] = SpendLog{
			RequestID: r.RequestID, At: r.At.UTC(), Region: r.Region, InstanceID: r.InstanceID, OrgID: r.OrgID,
			TeamID: r.TeamID, UserID: r.UserID, KeyID: r.KeyID, Project: r.Project, Customer: r.Customer,
			AgentID: r.AgentID, SessionID: r.SessionID, Tags: r.Tags, TrafficClass: r.TrafficClass, Route: r.Route,
			RequestedModel: r.RequestedModel, ModelGroup: r.ModelGroup, DeploymentID: r.DeploymentID, Stream: r.Stream,
			PromptTokens: r.PromptTokens, CompletionTokens: r.CompletionTokens, CachedTokens: r.CachedTokens,
			CacheCreationTokens: r.CacheCreationTokens, CostUSD: r.CostUsd, Status: r.Status, ErrorCode: r.ErrorCode, LatencyMS: r.LatencyMs, TTFTMS: r.TtftMs,
			Attempts: r.Attempts,
		}
	}
	return out, nil
}
