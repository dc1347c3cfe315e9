// Package spend consumes usage events from JetStream into the Postgres
// ledger (SPEC §9.2): spend_logs, one row per request, and the daily
// aggregates per org, team, user, key, customer, model group, deployment
// and tag.
//
// Every control-plane replica runs a Consumer on the same durable pull
// consumer (package ingest), so JetStream spreads batches across replicas.
// Each batch is recorded in one Postgres transaction and acknowledged only
// after it commits; a batch whose transaction fails is negatively
// acknowledged and redelivered. Recording is idempotent on the request id
// (the insert into spend_logs does nothing for a known id, and only
// inserted rows are added to the aggregates), so a redelivery — after a
// failed commit, a lost ack, or a replica that died mid-batch — never
// counts anything twice.
package spend

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
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

// Defaults (the batching ones are package ingest's, but for FetchWait).
const (
	// DefaultDurable is the durable consumer every replica shares.
	DefaultDurable   = "sluice-spend"
	DefaultBatchSize = ingest.DefaultBatchSize
	// DefaultFetchWait is shorter than ingest's (1 s): budget seeds wait
	// for the ledger to record the usage stream (package seeds), so a
	// partial batch is recorded after 200 ms rather than a second. Under
	// load batches fill first anyway; when idle it costs five pull
	// requests a second per replica.
	DefaultFetchWait  = 200 * time.Millisecond
	DefaultAckWait    = ingest.DefaultAckWait
	DefaultTxTimeout  = ingest.DefaultTxTimeout
	DefaultMaxBackoff = ingest.DefaultMaxBackoff
)

// Config configures a Consumer; zero values take the defaults.
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

// Stats are the consumer's counters since start: Recorded and Duplicates
// count usage events newly written to the ledger and already there;
// Undecodable counts events terminated because they do not decode or lack
// a request id.
type Stats = ingest.Stats

// Consumer records usage events into the ledger.
type Consumer struct {
	c *ingest.Consumer[store.SpendLog]
}

// New returns a consumer reading through nc, which must stay open while
// Run runs.
func New(cfg Config, st *store.Store, nc *nats.Conn) (*Consumer, error) {
	if cfg.Durable == "" {
		cfg.Durable = DefaultDurable
	}
	if cfg.FetchWait <= 0 {
		cfg.FetchWait = DefaultFetchWait
	}
	c, err := ingest.New(ingest.Config[store.SpendLog]{
		Stream: wire.UsageStream, Durable: cfg.Durable, What: "usage event",
		Description: "usage events into the spend ledger (every control-plane replica)",
		DecodeMany:  decode,
		Record: func(ctx context.Context, logs []store.SpendLog) (ingest.Recorded, error) {
			res, err := st.SpendRecord(ctx, logs)
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

// Run consumes until ctx is done. It waits for the usage stream to exist
// (the publishing leader creates it) and survives NATS and Postgres
// outages, retrying with backoff.
func (c *Consumer) Run(ctx context.Context) error { return c.c.Run(ctx) }

// ErrNoRequestID marks a usage event without a request id.
var ErrNoRequestID = errors.New("usage event has no request id")

// decode converts a usage message into ledger rows: one UsageEvent (no
// encoding header: every data plane before batches, and with
// --usage-batch-events 1) or a UsageBatch (wire.UsageEncodingBatchV1).
// Events without a request id are rejected, the rest of their batch is
// recorded; a batch may repeat a request id, which the ledger records
// once. Another encoding is left in the stream for a newer build. An
// event without a time takes the time JetStream stored it.
func decode(m jetstream.Msg) ([]store.SpendLog, []error, error) {
	stored := func() time.Time {
		if md, err := m.Metadata(); err == nil {
			return md.Timestamp
		}
		return time.Now()
	}
	switch enc := m.Headers().Get(wire.UsageEncodingHeader); enc {
	case "":
		ev := &usagev1.UsageEvent{}
		if err := proto.Unmarshal(m.Data(), ev); err != nil {
			return nil, nil, fmt.Errorf("decode usage event: %w", err)
		}
		if ev.GetRequestId() == "" {
			return nil, nil, ErrNoRequestID
		}
		return []store.SpendLog{FromEvent(ev, eventTime(ev, stored))}, nil, nil
	case wire.UsageEncodingBatchV1:
		return decodeBatch(m.Data(), stored)
	default:
		return nil, nil, fmt.Errorf("%w: usage message encoding %q (this build reads %q)", ingest.ErrNotYet, enc, wire.UsageEncodingBatchV1)
	}
}

// eventTime is ev's time, or else stored() (the time JetStream stored its
// message).
func eventTime(ev *usagev1.UsageEvent, stored func() time.Time) time.Time {
	if ev.GetTime() != nil && ev.GetTime().CheckValid() == nil {
		return ev.GetTime().AsTime()
	}
	return stored()
}

// decodeBatch decodes a UsageBatch into ledger rows (parseBatch);
// events without a request id are rejected.
func decodeBatch(data []byte, stored func() time.Time) ([]store.SpendLog, []error, error) {
	b, err := parseBatch(data)
	if err != nil {
		return nil, nil, fmt.Errorf("decode usage batch: %w", err)
	}
	logs := make([]store.SpendLog, 0, len(b.events))
	var (
		rejected []error
		at       *time.Time
	)
	for i := range b.events {
		ev := &b.events[i]
		if ev.log.RequestID == "" {
			rejected = append(rejected, fmt.Errorf("event %d of usage batch %q: %w", i, b.id, ErrNoRequestID))
			continue
		}
		if !ev.hasTime {
			if at == nil {
				t := stored()
				at = &t
			}
			ev.log.At = *at
		}
		logs = append(logs, cleanLog(ev.log))
	}
	return logs, rejected, nil
}

// FromEvent converts ev, recorded at at, to a ledger row. NUL bytes, which
// Postgres text refuses (and which a request body's "model" can carry as
// \u0000), are replaced by U+FFFD: a row is never lost or stuck over one.
func FromEvent(ev *usagev1.UsageEvent, at time.Time) store.SpendLog {
	tags := ev.GetTags()
	for i, t := range tags {
		if strings.IndexByte(t, 0) >= 0 {
			tags = slices.Clone(tags)
			tags[i] = clean(t)
		}
	}
	return store.SpendLog{
		RequestID: clean(ev.GetRequestId()), At: at.UTC(), Region: clean(ev.GetRegion()), InstanceID: clean(ev.GetInstanceId()),
		OrgID: clean(ev.GetOrgId()), TeamID: clean(ev.GetTeamId()), UserID: clean(ev.GetUserId()), KeyID: clean(ev.GetKeyId()),
		Project: clean(ev.GetProject()), Customer: clean(ev.GetCustomer()), AgentID: clean(ev.GetAgentId()), SessionID: clean(ev.GetSessionId()),
		Tags: tags, TrafficClass: clean(ev.GetTrafficClass()), Route: clean(ev.GetRoute()), RequestedModel: clean(ev.GetRequestedModel()),
		ModelGroup: clean(ev.GetModelGroup()), DeploymentID: clean(ev.GetDeploymentId()), Stream: ev.GetStream(),
		PromptTokens: ev.GetPromptTokens(), CompletionTokens: ev.GetCompletionTokens(), CachedTokens: ev.GetCachedTokens(),
		CacheCreationTokens: ev.GetCacheCreationTokens(), CostUSD: ev.GetCostUsd(), Status: ev.GetStatus(), ErrorCode: clean(ev.GetErrorCode()), LatencyMS: ev.GetLatencyMs(),
		TTFTMS: ev.GetTtftMs(), Attempts: ev.GetAttempts(),
	}
}

// cleanLog is l with NUL bytes replaced as FromEvent does, and its time
// in UTC.
func cleanLog(l store.SpendLog) store.SpendLog {
	for _, p := range [...]*string{&l.RequestID, &l.Region, &l.InstanceID, &l.OrgID, &l.TeamID, &l.UserID, &l.KeyID,
		&l.Project, &l.Customer, &l.AgentID, &l.SessionID, &l.TrafficClass, &l.Route, &l.RequestedModel,
		&l.ModelGroup, &l.DeploymentID, &l.ErrorCode} {
		*p = clean(*p)
	}
	for i, t := range l.Tags {
		if strings.IndexByte(t, 0) >= 0 {
			l.Tags[i] = clean(t) // the decoder's own slice
		}
	}
	l.At = l.At.UTC()
	return l
}

func clean(s string) string {
	if strings.IndexByte(s, 0) < 0 {
		return s
	}
	return strings.ReplaceAll(s, "\x00", "\uFFFD")
}
