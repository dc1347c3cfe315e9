package store

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
)

// BudgetAlert is a budget threshold a scope crossed in one budget window
// (SPEC §8.3), as a data plane raised it. Amounts are micro-USD.
type BudgetAlert struct {
	// AlertID is deterministic per scope, window and threshold: the
	// same alert raised twice has the same id.
	AlertID   string
	FiredAt   time.Time
	OrgID     string
	TeamID    string // "" when the scope belongs to no team
	ScopeKind string // a budget.Kind constant
	ScopeID   string
	// ThresholdPercent is the percentage of the cap; 0 means the soft
	// budget.
	ThresholdPercent int32
	SpendMicros      int64
	CapMicros        int64
	SoftMicros       int64
	// Window is the budget_duration; WindowStart the window's start.
	Window      string
	WindowStart time.Time
	Region      string
	InstanceID  string
	RequestID   string
}

func alertFromRow(r dbsqlc.BudgetAlert) BudgetAlert {
	return BudgetAlert{
		AlertID: r.AlertID, FiredAt: r.FiredAt.UTC(), OrgID: r.OrgID, TeamID: r.TeamID, ScopeKind: r.ScopeKind,
		ScopeID: r.ScopeID, ThresholdPercent: r.ThresholdPercent, SpendMicros: r.SpendMicros, CapMicros: r.CapMicros,
		SoftMicros: r.SoftMicros, Window: r.BudgetDuration, WindowStart: r.WindowStart.UTC(), Region: r.Region,
		InstanceID: r.InstanceID, RequestID: r.RequestID,
	}
}

// AlertRecordResult says what AlertRecord did.
type AlertRecordResult struct {
	// Inserted counts new alerts; Duplicates counts alerts whose id was
	// already recorded (redeliveries, or a second data plane raising the
	// same alert), which changed nothing.
	Inserted, Duplicates int
}

// AlertRecord records alerts in one transaction, skipping every alert
// whose id is already recorded, so recording the same alert twice changes
// nothing the second time. On error nothing is recorded.
func (s *Store) AlertRecord(ctx context.Context, alerts []BudgetAlert) (AlertRecordResult, error) {
	var res AlertRecordResult
	if len(alerts) == 0 {
		return res, nil
	}
	// In id order, so concurrent consumers lock in one order.
	sorted := slices.Clone(alerts)
	slices.SortFunc(sorted, func(a, b BudgetAlert) int { return strings.Compare(a.AlertID, b.AlertID) })
	params := make([]dbsqlc.AlertInsertParams, len(sorted))
	for i, a := range sorted {
		params[i] = dbsqlc.AlertInsertParams{
			AlertID: a.AlertID, FiredAt: a.FiredAt.UTC(), OrgID: a.OrgID, TeamID: a.TeamID, ScopeKind: a.ScopeKind,
			ScopeID: a.ScopeID, ThresholdPercent: a.ThresholdPercent, SpendMicros: a.SpendMicros, CapMicros: a.CapMicros,
			SoftMicros: a.SoftMicros, BudgetDuration: a.Window, WindowStart: a.WindowStart.UTC(), Region: a.Region,
			InstanceID: a.InstanceID, RequestID: a.RequestID,
		}
	}
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		res = AlertRecordResult{}
		var batchErr error
		var inserted []string
		s.q.AlertInsert(ctx, tx, params).QueryRow(func(_ int, id string, err error) {
			switch {
			case err == nil:
				res.Inserted++
				inserted = append(inserted, id)
			case errors.Is(err, pgx.ErrNoRows): // already recorded
				res.Duplicates++
			case batchErr == nil:
				batchErr = err
			}
		})
		if batchErr != nil {
			return fmt.Errorf("insert budget alerts: %w", batchErr)
		}
		if len(inserted) == 0 {
			return nil
		}
		// The delivery outbox: one row per new alert and webhook of its
		// org, committed with the alert (docs/alerts.md).
		if err := s.q.DeliveryEnqueue(ctx, tx, dbsqlc.DeliveryEnqueueParams{Now: s.Now(), AlertIds: inserted}); err != nil {
			return fmt.Errorf("enqueue alert deliveries: %w", err)
		}
		return nil
	})
	if err != nil {
		return AlertRecordResult{}, fmt.Errorf("record budget alerts: %w", err)
	}
	return res, nil
}

// AlertQuery filters AlertList; empty fields mean "any".
type AlertQuery struct {
	Tenant
	ScopeKind string
	ScopeID   string
	// Since keeps alerts fired at or after it.
	Since *time.Time
	// AfterAt and AfterID are the keyset cursor: the (FiredAt, AlertID)
	// of the last alert of the previous page (zero AfterAt: first page).
	AfterAt time.Time
	AfterID string
}

// AlertList returns up to limit alerts matching q, newest first.
func (s *Store) AlertList(ctx context.Context, q AlertQuery, limit int) ([]BudgetAlert, error) {
	p := dbsqlc.AlertListParams{
		OrgID: optStr(q.OrgID), TeamID: optStr(q.TeamID), ScopeKind: optStr(q.ScopeKind), ScopeID: optStr(q.ScopeID),
		Since: q.Since, AfterID: q.AfterID, Lim: int32(limit),
	}
	if !q.AfterAt.IsZero() {
		at := q.AfterAt
		p.AfterAt = &at
	}
	rows, err := s.q.AlertList(ctx, s.pool, p)
	if err != nil {
		return nil, fmt.Errorf("list budget alerts: %w", err)
	}
	out := make([]BudgetAlert, len(rows))
	for i, r := range rows {
		out[i] = alertFromRow(r)
	}
	return out, nil
}
