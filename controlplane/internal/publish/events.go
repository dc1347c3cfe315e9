// Events: outbox rows appended to region streams, in order, with the
// region's sequence checked on every append.

package publish

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/controlplane/internal/events"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// publishAll publishes every pending outbox row. It reports whether any
// configuration changed and which regions' pointers must be rewritten.
func (p *Publisher) publishAll(ctx context.Context) (bool, map[string]bool, error) {
	changed := false
	pointerRegions := map[string]bool{}
	for {
		n, err := p.store.PublishPending(ctx, batchSize, func(ctx context.Context, rows []store.OutboxRow, regions []store.RegionState) (map[string]int64, error) {
			seqs := map[string]int64{}
			for _, r := range regions {
				seqs[r.Name] = r.RegionSeq
			}
			for _, row := range rows {
				spec, err := events.Lookup(row.Kind)
				if err != nil {
					return nil, fmt.Errorf("outbox row %d: %w", row.Seq, err)
				}
				if spec.Op == events.OpPointer {
					pointerRegions[row.ObjectID] = true
					if err := p.ensureStream(ctx, row.ObjectID); err != nil {
						return nil, err
					}
					for _, r := range regions {
						if r.Name == row.ObjectID && r.CurrentVersion == 0 && seqs[r.Name] == 0 {
							last, err := p.adoptStream(ctx, r.Name)
							if err != nil {
								return nil, err
							}
							seqs[r.Name] = last
						}
					}
					continue
				}
				changed = true
				ev, err := events.Build(ctx, p.store, row, time.Now())
				if err != nil {
					return nil, fmt.Errorf("build event %d (%s): %w", row.Seq, row.Kind, err)
				}
				for _, r := range regions {
					if r.Policy != "auto" && !ev.Security {
						continue
					}
					next := seqs[r.Name] + 1
					data, err := proto.Marshal(&configv1.RegionEvent{Region: r.Name, RegionSeq: uint64(next), Event: ev})
					if err != nil {
						return nil, err
					}
					pctx, cancel := context.WithTimeout(ctx, publishTimeout)
					_, err = p.js.Publish(pctx, wire.EventSubject(r.Name), data,
						jetstream.WithMsgID(wire.EventMsgID(r.Name, uint64(next))),
						jetstream.WithExpectLastSequence(uint64(next-1)))
					cancel()
					if err != nil && !p.appendedBefore(ctx, r.Name, uint64(next), row) {
						return nil, fmt.Errorf("publish event %d to region %s: %w", row.Seq, r.Name, err)
					}
					seqs[r.Name] = next
					p.eventsPublished.Add(1)
				}
			}
			return seqs, nil
		})
		if err != nil {
			return changed, pointerRegions, err
		}
		if n < batchSize {
			return changed, pointerRegions, nil
		}
	}
}

// appendedBefore reports whether region's stream already holds the event
// of outbox row seq at regionSeq. A leader that died after appending it
// but before recording the region position in Postgres leaves it there,
// and the next leader's append of the same row fails: the server checks
// the expected last sequence before its dedupe window, so the retry is
// refused rather than acknowledged as a duplicate. The stored copy stands
// (events carry state, and later rows carry later state). The stored
// event must be of the row's kind and object too: a stream from another
// history (a restored database) may hold the same sequence numbers.
func (p *Publisher) appendedBefore(ctx context.Context, region string, regionSeq uint64, row store.OutboxRow) bool {
	s, err := p.js.Stream(ctx, wire.EventStream(region))
	if err != nil {
		return false
	}
	m, err := s.GetMsg(ctx, regionSeq)
	if err != nil {
		return false
	}
	re := &configv1.RegionEvent{}
	if proto.Unmarshal(m.Data, re) != nil || re.GetRegionSeq() != regionSeq || re.GetEvent().GetSeq() != uint64(row.Seq) ||
		!eventIsRow(re.GetEvent(), row.Kind, row.ObjectType, row.ObjectID) {
		return false
	}
	p.log.Warn("event already appended by an earlier leader; keeping it", "region", region, "region_seq", regionSeq, "seq", row.Seq)
	return true
}
