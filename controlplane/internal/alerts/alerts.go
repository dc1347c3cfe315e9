// Package alerts records the budget alerts data planes raise (SPEC §8.3)
// into Postgres (budget_alerts), where AlertService.ListAlerts reads them.
//
// A data plane publishes a sluice.usage.v1.BudgetAlert to
// sluice.alerts.<region> (stream SLUICE_ALERTS, created by the publishing
// leader) when a settled request makes a scope's spend cross its soft
// budget or a percentage of its cap; alert_id is deterministic per scope,
// window and threshold and is the message's Nats-Msg-Id. Every
// control-plane replica runs a Consumer on the same durable consumer
// (package ingest): a batch is inserted in one transaction with ON
// CONFLICT (alert_id) DO NOTHING and acknowledged after the commit, so an
// alert republished outside JetStream's dedupe window, raised by two data
// planes, or redelivered after a lost ack is recorded once.
package alerts

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/controlplane/internal/ingest"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// DefaultDurable is the durable consumer every replica shares.
const DefaultDurable = "sluice-alerts"

// Config configures a Consumer; zero values take package ingest's
// defaults.
type Config struct {
	// Durable names the JetStream durable consumer.
	Durable   string
	BatchSize int
	FetchWait time.Duration
	AckWait   time.Duration
	TxTimeout time.Duration
	// MaxBackoff caps the wait after a failed fetch or transaction.
	MaxBackoff time.Duration
	Logger     *slog.Logger
}

// Stats are the consumer's counters since start: Recorded counts alerts
// newly written, Duplicates alerts already recorded, Undecodable alerts
// terminated as malformed.
type Stats = ingest.Stats

// Consumer records budget alerts.
type Consumer struct {
	c *ingest.Consumer[store.BudgetAlert]
}

// New returns a consumer reading through nc, which must stay open while
// Run runs.
func New(cfg Config, st *store.Store, nc *nats.Conn) (*Consumer, error) {
	if cfg.Durable == "" {
		cfg.Durable = DefaultDurable
	}
	c, err := ingest.New(ingest.Config[store.BudgetAlert]{
		Stream: wire.AlertStream, Durable: cfg.Durable, What: "budget alert",
		Description: "budget alerts into budget_alerts (every control-plane replica)",
		Decode:      decode,
		Record: func(ctx context.Context, alerts []store.BudgetAlert) (ingest.Recorded, error) {
			res, err := st.AlertRecord(ctx, alerts)
			return ingest.Recorded{Inserted: res.Inserted, Duplicates: res.Duplicates}, err
		},
		BatchSize: cfg.BatchSize, FetchWait: cfg.FetchWait, AckWait: cfg.AckWait, TxTimeout: cfg.TxTimeout,
		MaxBackoff: cfg.MaxBackoff, Logger: cfg.Logger,
	}, nc)
	if err != nil {
		return nil, err
	}
	return &Consumer{c: c}, nil
}

// Stats returns the counters.
func (c *Consumer) Stats() Stats { return c.c.Stats() }

// Run consumes until ctx is done. It waits for the alert stream to exist
// and survives NATS and Postgres outages, retrying with backoff.
func (c *Consumer) Run(ctx context.Context) error { return c.c.Run(ctx) }

// The Unix seconds of 0001-01-01 and 9999-12-31T23:59:59Z: the range of
// protobuf timestamps, which Postgres timestamptz holds.
const (
	minUnix = -62135596800
	maxUnix = 253402300799
)

// ErrInvalid marks an alert that can never be recorded.
var ErrInvalid = errors.New("invalid budget alert")

// decode converts an alert message into a row. An alert without a time
// takes the time JetStream stored it. Alerts the table could never take
// (no id, org or scope; a NUL byte, which Postgres text refuses; a window
// start Postgres cannot store) are refused here, so they are terminated instead of failing their batch on
// every redelivery.
func decode(m jetstream.Msg) (store.BudgetAlert, error) {
	a := &usagev1.BudgetAlert{}
	if err := proto.Unmarshal(m.Data(), a); err != nil {
		return store.BudgetAlert{}, fmt.Errorf("decode budget alert: %w", err)
	}
	at := a.GetTime().AsTime()
	if a.GetTime() == nil || a.GetTime().CheckValid() != nil {
		at = time.Now()
		if md, err := m.Metadata(); err == nil {
			at = md.Timestamp
		}
	}
	return FromAlert(a, at)
}

// FromAlert converts a, fired at at, to a row, or fails with ErrInvalid.
func FromAlert(a *usagev1.BudgetAlert, at time.Time) (store.BudgetAlert, error) {
	for _, f := range []struct{ name, v string }{
		{"alert_id", a.GetAlertId()}, {"org_id", a.GetOrgId()}, {"scope_kind", a.GetScopeKind()}, {"scope_id", a.GetScopeId()},
	} {
		if f.v == "" {
			return store.BudgetAlert{}, fmt.Errorf("%w: no %s", ErrInvalid, f.name)
		}
	}
	for _, v := range []string{a.GetAlertId(), a.GetOrgId(), a.GetTeamId(), a.GetScopeKind(), a.GetScopeId(),
		a.GetWindow(), a.GetRegion(), a.GetInstanceId(), a.GetRequestId()} {
		if strings.IndexByte(v, 0) >= 0 {
			return store.BudgetAlert{}, fmt.Errorf("%w: NUL byte in alert %q", ErrInvalid, a.GetAlertId())
		}
	}
	if ws := a.GetWindowStart(); ws < minUnix || ws > maxUnix {
		return store.BudgetAlert{}, fmt.Errorf("%w: window_start %d is outside the years 1-9999", ErrInvalid, ws)
	}
	return store.BudgetAlert{
		AlertID: a.GetAlertId(), FiredAt: at.UTC(), OrgID: a.GetOrgId(), TeamID: a.GetTeamId(), ScopeKind: a.GetScopeKind(),
		ScopeID: a.GetScopeId(), ThresholdPercent: a.GetThresholdPercent(), SpendMicros: a.GetSpendMicros(),
		CapMicros: a.GetCapMicros(), SoftMicros: a.GetSoftMicros(), Window: a.GetWindow(),
		WindowStart: time.Unix(a.GetWindowStart(), 0).UTC(), Region: a.GetRegion(), InstanceID: a.GetInstanceId(),
		RequestID: a.GetRequestId(),
	}, nil
}
