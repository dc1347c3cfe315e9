package dataplane

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/sluicegw/sluice/dataplane/internal/gateway"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// explainTimeout bounds one explain request's dry run (its Redis reads
// are bounded by their own call timeouts; this covers the rest).
const explainTimeout = 5 * time.Second

// explainMaxInFlight bounds the explain requests one data plane runs at
// once: explain is an operator's tool, never allowed to compete with
// traffic; requests beyond it are answered unavailable.
const explainMaxInFlight = 4

// subscribeExplain answers the region's explain requests
// (wire.ExplainSubject, queue group wire.ExplainQueue) by running the
// gateway's pipeline in dry run (docs/explain.md).
func (d *DataPlane) subscribeExplain() (*nats.Subscription, error) {
	slots := make(chan struct{}, explainMaxInFlight)
	return d.nc.QueueSubscribe(wire.ExplainSubject(d.cfg.Region), wire.ExplainQueue, func(m *nats.Msg) {
		select {
		case slots <- struct{}{}:
		default:
			d.replyExplain(m, &configv1.ExplainWireReply{Error: "unavailable", Detail: "this data plane is already explaining other requests; retry"})
			return
		}
		go func() {
			defer func() { <-slots }()
			d.replyExplain(m, d.explain(m.Data))
		}()
	})
}

// explain decodes and runs one explain request.
func (d *DataPlane) explain(data []byte) *configv1.ExplainWireReply {
	req := &configv1.ExplainWireRequest{}
	if err := wire.Unmarshal(data, req); err != nil {
		return &configv1.ExplainWireReply{Error: "invalid_argument", Detail: "the explain request does not decode"}
	}
	ctx, cancel := context.WithTimeout(context.Background(), explainTimeout)
	defer cancel()
	tr, err := d.proxy.Explain(ctx, gateway.ExplainScope{OrgID: req.GetScopeOrgId(), TeamID: req.GetScopeTeamId()}, req.GetQuery())
	switch {
	case errors.Is(err, gateway.ErrExplainNotFound):
		return &configv1.ExplainWireReply{Error: "not_found", Detail: "no such key, token or issuer in the caller's scope"}
	case errors.Is(err, gateway.ErrExplainInvalid):
		return &configv1.ExplainWireReply{Error: "invalid_argument", Detail: err.Error()}
	case err != nil:
		d.log.Error("explain failed", "error", err)
		return &configv1.ExplainWireReply{Error: "internal", Detail: "the data plane could not explain the request"}
	}
	return &configv1.ExplainWireReply{Trace: tr}
}

func (d *DataPlane) replyExplain(m *nats.Msg, rep *configv1.ExplainWireReply) {
	data, err := wire.Marshal(rep)
	if err == nil {
		err = m.Respond(data)
	}
	if err != nil {
		d.log.Warn("explain reply not sent", "error", fmt.Errorf("reply: %w", err))
	}
}
