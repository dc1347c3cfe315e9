// Liveness: ticks every replica publishes, heartbeats it records.

package publish

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

func (p *Publisher) tickLoop(ctx context.Context) {
	t := time.NewTicker(p.cfg.TickInterval)
	defer t.Stop()
	for {
		data, _ := proto.Marshal(&configv1.Tick{At: timestamppb.Now(), ControlInstance: p.cfg.InstanceID})
		if err := p.nc.Publish(wire.TickSubject, data); err != nil && ctx.Err() == nil {
			p.log.Debug("tick not sent", "error", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (p *Publisher) heartbeatLoop(ctx context.Context) error {
	if p.cfg.OnHeartbeat == nil {
		return nil
	}
	ch := make(chan *nats.Msg, 1024)
	sub, err := p.nc.ChanQueueSubscribe(wire.HeartbeatSubjectAll, "sluice-control", ch)
	if err != nil {
		return fmt.Errorf("subscribe to heartbeats: %w", err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	for {
		select {
		case <-ctx.Done():
			return nil
		case m := <-ch:
			hb := &configv1.Heartbeat{}
			if err := proto.Unmarshal(m.Data, hb); err != nil {
				p.log.Warn("undecodable heartbeat", "subject", m.Subject)
				continue
			}
			p.heartbeats.Add(1)
			if err := p.cfg.OnHeartbeat(ctx, hb); err != nil && ctx.Err() == nil {
				p.log.Warn("heartbeat not recorded", "instance", hb.GetInstanceId(), "error", err)
			}
		}
	}
}
