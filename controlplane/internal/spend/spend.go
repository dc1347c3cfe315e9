// Package spend consumes usage events from JetStream into the Postgres
// ledger (SPEC §9.2): spend_logs, one row per request, and the daily
// aggregates per org, team, user, key, customer, model group, deployment
// and tag.
//
// Every control-plane replica runs a Consumer on the same durable pull
// consumer, so JetStream spreads batches across replicas. Each batch is
// recorded in one Postgres transaction and acknowledged only after it
// commits; a batch whose transaction fails is negatively acknowledged and
// redelivered. Recording is idempotent on the request id (the insert into
// spend_logs does nothing for a known id, and only inserted rows are added
// to the aggregates), so a redelivery — after a failed commit, a lost ack,
// or a replica that died mid-batch — never counts anything twice.
package spend

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// Defaults.
const (
	// DefaultDurable is the durable consumer every replica shares.
	DefaultDurable = "sluice-spend"
	// DefaultBatchSize is how many events one transaction records.
	DefaultBatchSize = 500
	// DefaultFetchWait bounds how long a fetch waits for a full batch.
	DefaultFetchWait = time.Second
	// DefaultAckWait is how long JetStream waits for an ack before it
	// redelivers: longer than a batch transaction ever takes.
	DefaultAckWait = 30 * time.Second
	// DefaultTxTimeout bounds one batch transaction, so an unreachable
	// Postgres fails the batch (and it is redelivered) well within AckWait.
	DefaultTxTimeout = 15 * time.Second
	// DefaultMaxBackoff caps the wait between retries after failures.
	DefaultMaxBackoff = 5 * time.Second
	minBackoff        = 100 * time.Millisecond
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

func (c *Config) defaults() {
	if c.Durable == "" {
		c.Durable = DefaultDurable
	}
	if c.BatchSize <= 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.FetchWait <= 0 {
		c.FetchWait = DefaultFetchWait
	}
	if c.AckWait <= 0 {
		c.AckWait = DefaultAckWait
	}
	if c.TxTimeout <= 0 {
		c.TxTimeout = DefaultTxTimeout
	}
	if c.MaxBackoff <= 0 {
		c.MaxBackoff = DefaultMaxBackoff
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
}

// Stats are the consumer's counters since start.
type Stats struct {
	// Batches is the number of batches committed.
	Batches int64
	// Recorded counts events newly written to the ledger.
	Recorded int64
	// Duplicates counts events whose request id was already recorded.
	Duplicates int64
	// Undecodable counts events terminated because they do not decode or
	// lack a request id.
	Undecodable int64
	// Failures counts failed batch transactions (the batch is redelivered).
	Failures int64
	// FetchErrors counts failed fetches (NATS unreachable, ...).
	FetchErrors int64
}

// Consumer records usage events into the ledger.
type Consumer struct {
	cfg   Config
	store *store.Store
	js    jetstream.JetStream
	log   *slog.Logger

	batches, recorded, duplicates, undecodable, failures, fetchErrors atomic.Int64
}

// New returns a consumer reading through nc, which must stay open while
// Run runs.
func New(cfg Config, st *store.Store, nc *nats.Conn) (*Consumer, error) {
	cfg.defaults()
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	return &Consumer{cfg: cfg, store: st, js: js, log: cfg.Logger}, nil
}

// Stats returns the counters.
func (c *Consumer) Stats() Stats {
	return Stats{Batches: c.batches.Load(), Recorded: c.recorded.Load(), Duplicates: c.duplicates.Load(),
		Undecodable: c.undecodable.Load(), Failures: c.failures.Load(), FetchErrors: c.fetchErrors.Load()}
}

// Run consumes until ctx is done. It waits for the usage stream to exist
// (the publishing leader creates it) and survives NATS and Postgres
// outages, retrying with backoff.
func (c *Consumer) Run(ctx context.Context) error {
	backoff := minBackoff
	wait := func() bool {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, c.cfg.MaxBackoff)
		return true
	}
	var cons jetstream.Consumer
	for cons == nil {
		var err error
		cons, err = c.js.CreateOrUpdateConsumer(ctx, wire.UsageStream, jetstream.ConsumerConfig{
			Durable:       c.cfg.Durable,
			Description:   "usage events into the spend ledger (every control-plane replica)",
			AckPolicy:     jetstream.AckExplicitPolicy,
			AckWait:       c.cfg.AckWait,
			MaxDeliver:    -1,
			MaxAckPending: 20 * c.cfg.BatchSize,
			DeliverPolicy: jetstream.DeliverAllPolicy,
		})
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if errors.Is(err, jetstream.ErrStreamNotFound) {
				c.log.Debug("usage stream not there yet; waiting for the publisher to create it", "stream", wire.UsageStream)
			} else {
				c.log.Warn("create spend consumer", "error", err)
			}
			if !wait() {
				return nil
			}
		}
	}
	backoff = minBackoff
	c.log.Info("spend consumer running", "stream", wire.UsageStream, "durable", c.cfg.Durable)
	for ctx.Err() == nil {
		ok, err := c.fetchOnce(ctx, cons)
		if err != nil && ctx.Err() == nil {
			c.log.Warn("spend batch failed; it will be redelivered", "error", err, "retry_in_ms", backoff.Milliseconds())
			if !wait() {
				return nil
			}
			continue
		}
		if ok {
			backoff = minBackoff
		}
	}
	return nil
}

// fetchOnce fetches and records one batch. It reports whether the round
// trip worked (an empty batch is fine).
func (c *Consumer) fetchOnce(ctx context.Context, cons jetstream.Consumer) (bool, error) {
	// The fetch ends after FetchWait (a partial batch is fine). It is not
	// cut short by shutdown: messages the server already handed to a
	// cancelled fetch would wait out AckWait before anyone else got them.
	// A batch in hand is recorded and acknowledged before Run returns.
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.FetchWait)
	defer cancel()
	batch, err := cons.Fetch(c.cfg.BatchSize, jetstream.FetchContext(fctx))
	if err != nil {
		c.fetchErrors.Add(1)
		return false, fmt.Errorf("fetch usage events: %w", err)
	}
	var msgs []jetstream.Msg
	for m := range batch.Messages() {
		msgs = append(msgs, m)
	}
	if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, context.DeadlineExceeded) && len(msgs) == 0 {
		c.fetchErrors.Add(1)
		return false, fmt.Errorf("fetch usage events: %w", err)
	}
	if len(msgs) == 0 {
		return true, nil
	}
	return true, c.record(ctx, msgs)
}

// record writes msgs in one transaction, then acks them. Undecodable
// messages are terminated (they would never decode on redelivery).
func (c *Consumer) record(ctx context.Context, msgs []jetstream.Msg) error {
	logs := make([]store.SpendLog, 0, len(msgs))
	good := make([]jetstream.Msg, 0, len(msgs))
	for _, m := range msgs {
		l, err := decode(m)
		if err != nil {
			c.undecodable.Add(1)
			c.log.Error("undecodable usage event dropped from the ledger", "subject", m.Subject(), "error", err)
			if terr := m.TermWithReason("undecodable usage event"); terr != nil {
				c.log.Warn("terminate undecodable usage event", "error", terr)
			}
			continue
		}
		logs = append(logs, l)
		good = append(good, m)
	}
	if len(logs) == 0 {
		return nil
	}
	tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.TxTimeout)
	res, err := c.store.SpendRecord(tctx, logs)
	cancel()
	if err != nil {
		c.failures.Add(1)
		// Ask for redelivery soon rather than after AckWait; if the nak
		// is lost, AckWait redelivers anyway.
		for _, m := range good {
			_ = m.NakWithDelay(time.Second)
		}
		return err
	}
	c.batches.Add(1)
	c.recorded.Add(int64(res.Inserted))
	c.duplicates.Add(int64(res.Duplicates))
	for _, m := range good {
		// A lost ack means a redelivery, which records nothing twice.
		if err := m.Ack(); err != nil {
			c.log.Warn("ack usage event (it will be redelivered and skipped)", "error", err)
		}
	}
	return nil
}

// ErrNoRequestID marks a usage event without a request id.
var ErrNoRequestID = errors.New("usage event has no request id")

// decode converts a usage event message into a ledger row. An event
// without a time takes the time JetStream stored it.
func decode(m jetstream.Msg) (store.SpendLog, error) {
	ev := &usagev1.UsageEvent{}
	if err := proto.Unmarshal(m.Data(), ev); err != nil {
		return store.SpendLog{}, fmt.Errorf("decode usage event: %w", err)
	}
	if ev.GetRequestId() == "" {
		return store.SpendLog{}, ErrNoRequestID
	}
	at := ev.GetTime().AsTime()
	if ev.GetTime() == nil || ev.GetTime().CheckValid() != nil {
		at = time.Now()
		if md, err := m.Metadata(); err == nil {
			at = md.Timestamp
		}
	}
	return FromEvent(ev, at), nil
}

// FromEvent converts ev, recorded at at, to a ledger row.
func FromEvent(ev *usagev1.UsageEvent, at time.Time) store.SpendLog {
	return store.SpendLog{
		RequestID: ev.GetRequestId(), At: at.UTC(), Region: ev.GetRegion(), InstanceID: ev.GetInstanceId(),
		OrgID: ev.GetOrgId(), TeamID: ev.GetTeamId(), UserID: ev.GetUserId(), KeyID: ev.GetKeyId(),
		Project: ev.GetProject(), Customer: ev.GetCustomer(), AgentID: ev.GetAgentId(), SessionID: ev.GetSessionId(),
		Tags: ev.GetTags(), TrafficClass: ev.GetTrafficClass(), Route: ev.GetRoute(), RequestedModel: ev.GetRequestedModel(),
		ModelGroup: ev.GetModelGroup(), DeploymentID: ev.GetDeploymentId(), Stream: ev.GetStream(),
		PromptTokens: ev.GetPromptTokens(), CompletionTokens: ev.GetCompletionTokens(), CachedTokens: ev.GetCachedTokens(),
		CostUSD: ev.GetCostUsd(), Status: ev.GetStatus(), ErrorCode: ev.GetErrorCode(), LatencyMS: ev.GetLatencyMs(),
		TTFTMS: ev.GetTtftMs(), Attempts: ev.GetAttempts(),
	}
}
