// Package ingest records what data planes publish to JetStream into
// Postgres: a durable pull consumer that decodes each message, writes a
// batch in one transaction and acknowledges the batch only after it
// commits. Package spend uses it for usage events, package alerts for
// budget alerts.
//
// Every control-plane replica runs a Consumer on the same durable
// consumer, so JetStream spreads batches across replicas. A batch whose
// transaction fails is negatively acknowledged and redelivered, so the
// Record function must be idempotent (insert-if-absent on the message's
// own id): a redelivery after a failed commit, a lost ack or a replica
// that died mid-batch then changes nothing. A message that does not
// decode is terminated (it would not decode on redelivery either), logged
// and counted, so one poison message never blocks the stream.
//
// A message may carry many items (DecodeMany: a data plane's batch of
// usage events). Its items are always recorded in the same transaction
// and the message acknowledged once it commits, so a message is recorded
// whole or not at all; a transaction takes whole messages until it holds
// at least BatchSize items.
package ingest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Defaults.
const (
	// DefaultBatchSize is how many messages one transaction records.
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

// ErrNotYet marks a message this build cannot read but a newer one can
// (an encoding from a newer data plane): it is left in the stream,
// negatively acknowledged with a delay (NotYetDelay), logged and counted,
// never terminated.
var ErrNotYet = errors.New("message needs a newer control plane")

// NotYetDelay is how long a message this build cannot read waits before
// it is delivered again.
const NotYetDelay = 30 * time.Second

// Recorded says what one Record call did.
type Recorded struct {
	// Inserted counts messages newly written; Duplicates counts messages
	// whose id was already recorded (redeliveries), which changed nothing.
	Inserted, Duplicates int
}

// Config configures a Consumer of items of type T; zero durations and
// sizes take the defaults.
type Config[T any] struct {
	// Stream is the JetStream stream read; the consumer waits for it to
	// exist (the publishing leader creates it).
	Stream string
	// Durable names the durable consumer every replica shares.
	Durable string
	// Description is the durable consumer's description.
	Description string
	// What names one message in logs ("usage event").
	What string
	// Decode turns a message into an item. An error terminates the
	// message: it must mean the message can never be recorded (but see
	// ErrNotYet).
	Decode func(jetstream.Msg) (T, error)
	// DecodeMany, instead of Decode, turns a message into any number of
	// items, recorded together. rejected lists items of the message that
	// can never be recorded: each is logged and counted as undecodable and
	// the message's other items are recorded. An error means the whole
	// message can never be recorded, as for Decode.
	DecodeMany func(jetstream.Msg) (items []T, rejected []error, err error)
	// Record writes items in one transaction, idempotently.
	Record func(ctx context.Context, items []T) (Recorded, error)

	BatchSize int
	FetchWait time.Duration
	AckWait   time.Duration
	TxTimeout time.Duration
	// MaxBackoff caps the wait after a failed fetch or transaction.
	MaxBackoff time.Duration
	Logger     *slog.Logger
}

func (c *Config[T]) defaults() {
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
	if c.What == "" {
		c.What = "message"
	}
}

// Stats are a consumer's counters since start.
type Stats struct {
	// Batches is the number of batches committed.
	Batches int64
	// Recorded counts messages newly written.
	Recorded int64
	// Duplicates counts messages whose id was already recorded.
	Duplicates int64
	// Undecodable counts messages terminated because they do not decode,
	// and items of a message that were rejected (DecodeMany).
	Undecodable int64
	// NotYet counts deliveries of messages left in the stream for a newer
	// build (ErrNotYet).
	NotYet int64
	// Failures counts failed batch transactions (the batch is redelivered).
	Failures int64
	// FetchErrors counts failed fetches (NATS unreachable, ...).
	FetchErrors int64
}

// Consumer records a stream's messages into Postgres.
type Consumer[T any] struct {
	cfg Config[T]
	js  jetstream.JetStream
	log *slog.Logger

	batches, recorded, duplicates, undecodable, notYet, failures, fetchErrors atomic.Int64
}

// New returns a consumer reading through nc, which must stay open while
// Run runs.
func New[T any](cfg Config[T], nc *nats.Conn) (*Consumer[T], error) {
	cfg.defaults()
	if cfg.Stream == "" || cfg.Durable == "" || (cfg.Decode == nil) == (cfg.DecodeMany == nil) || cfg.Record == nil {
		return nil, errors.New("ingest: Stream, Durable, Record and one of Decode and DecodeMany are required")
	}
	if cfg.DecodeMany == nil {
		decode := cfg.Decode
		cfg.DecodeMany = func(m jetstream.Msg) ([]T, []error, error) {
			it, err := decode(m)
			if err != nil {
				return nil, nil, err
			}
			return []T{it}, nil, nil
		}
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	return &Consumer[T]{cfg: cfg, js: js, log: cfg.Logger.With("stream", cfg.Stream, "durable", cfg.Durable)}, nil
}

// Stats returns the counters.
func (c *Consumer[T]) Stats() Stats {
	return Stats{Batches: c.batches.Load(), Recorded: c.recorded.Load(), Duplicates: c.duplicates.Load(),
		Undecodable: c.undecodable.Load(), NotYet: c.notYet.Load(), Failures: c.failures.Load(), FetchErrors: c.fetchErrors.Load()}
}

// Run consumes until ctx is done. It waits for the stream to exist and
// survives NATS and Postgres outages, retrying with backoff.
func (c *Consumer[T]) Run(ctx context.Context) error {
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
		cons, err = c.js.CreateOrUpdateConsumer(ctx, c.cfg.Stream, jetstream.ConsumerConfig{
			Durable:       c.cfg.Durable,
			Description:   c.cfg.Description,
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
				c.log.Debug("stream not there yet; waiting for the publisher to create it")
			} else {
				c.log.Warn("create durable consumer", "error", err)
			}
			if !wait() {
				return nil
			}
		}
	}
	backoff = minBackoff
	c.log.Info("consumer running")
	for ctx.Err() == nil {
		ok, err := c.fetchOnce(ctx, cons)
		if err != nil && ctx.Err() == nil {
			c.log.Warn("batch failed; it will be redelivered", "error", err, "retry_in_ms", backoff.Milliseconds())
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
func (c *Consumer[T]) fetchOnce(ctx context.Context, cons jetstream.Consumer) (bool, error) {
	// The fetch ends after FetchWait (a partial batch is fine), when the
	// server expires the pull request. It is bounded by that expiry, not
	// by a context: a fetch given up on the client side (shutdown, or a
	// context deadline, which nats.go gives the server only 90 % of)
	// drops the messages the server sent meanwhile, and those wait out
	// AckWait unacknowledged — 30 s during which the ledger's ack floor,
	// which budget seeds wait for, is stuck. A batch in hand is recorded
	// and acknowledged before Run returns.
	batch, err := cons.Fetch(c.cfg.BatchSize, jetstream.FetchMaxWait(c.cfg.FetchWait))
	if err != nil {
		c.fetchErrors.Add(1)
		return false, fmt.Errorf("fetch %ss: %w", c.cfg.What, err)
	}
	var msgs []jetstream.Msg
	for m := range batch.Messages() {
		msgs = append(msgs, m)
	}
	if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, context.DeadlineExceeded) && len(msgs) == 0 {
		c.fetchErrors.Add(1)
		return false, fmt.Errorf("fetch %ss: %w", c.cfg.What, err)
	}
	if len(msgs) == 0 {
		return true, nil
	}
	return true, c.record(ctx, msgs)
}

// record decodes msgs and writes them in transactions of whole messages,
// each of at least BatchSize items (or what is left), acknowledging each
// transaction's messages after it commits. Undecodable messages are
// terminated. When a transaction fails, its messages and every one not
// recorded yet are negatively acknowledged.
func (c *Consumer[T]) record(ctx context.Context, msgs []jetstream.Msg) error {
	var (
		items []T
		good  []jetstream.Msg
	)
	for i, m := range msgs {
		its, rejected, err := c.cfg.DecodeMany(m)
		switch {
		case errors.Is(err, ErrNotYet):
			c.notYet.Add(1)
			c.log.Error(c.cfg.What+" left in the stream: this control plane cannot read it; upgrade it",
				"subject", m.Subject(), "error", err)
			_ = m.NakWithDelay(NotYetDelay)
			continue
		case err != nil:
			c.undecodable.Add(1)
			c.log.Error("undecodable "+c.cfg.What+" dropped", "subject", m.Subject(), "error", err)
			if terr := m.TermWithReason("undecodable " + c.cfg.What); terr != nil {
				c.log.Warn("terminate undecodable "+c.cfg.What, "error", terr)
			}
			continue
		}
		for _, rerr := range rejected {
			c.undecodable.Add(1)
			c.log.Error("undecodable "+c.cfg.What+" dropped", "subject", m.Subject(), "error", rerr)
		}
		items = append(items, its...)
		good = append(good, m)
		if len(items) < c.cfg.BatchSize && i < len(msgs)-1 {
			continue
		}
		if err := c.commit(ctx, items, good); err != nil {
			for _, m := range msgs[i+1:] {
				_ = m.NakWithDelay(time.Second)
			}
			return err
		}
		items, good = nil, nil
	}
	if len(good) > 0 {
		return c.commit(ctx, items, good)
	}
	return nil
}

// commit records items in one transaction, then acks msgs (or naks them
// when the transaction fails).
func (c *Consumer[T]) commit(ctx context.Context, items []T, msgs []jetstream.Msg) error {
	if len(items) > 0 {
		tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.TxTimeout)
		res, err := c.cfg.Record(tctx, items)
		cancel()
		if err != nil {
			c.failures.Add(1)
			// Ask for redelivery soon rather than after AckWait; if the nak
			// is lost, AckWait redelivers anyway.
			for _, m := range msgs {
				_ = m.NakWithDelay(time.Second)
			}
			return err
		}
		c.batches.Add(1)
		c.recorded.Add(int64(res.Inserted))
		c.duplicates.Add(int64(res.Duplicates))
	}
	for _, m := range msgs {
		// A lost ack means a redelivery, which records nothing twice.
		if err := m.Ack(); err != nil {
			c.log.Warn("ack "+c.cfg.What+" (it will be redelivered and skipped)", "error", err)
		}
	}
	return nil
}
