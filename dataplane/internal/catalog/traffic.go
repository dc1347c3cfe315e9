package catalog

import (
	"sync/atomic"

	"github.com/sluicegw/sluice/dataplane/internal/classify"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// TrafficPolicy is an org's compiled classification policy (package
// classify), compiled once per org record, not per request.
//
// Err is set when the org's settings did not compile (a snapshot that did
// not come from a control plane validating them): Policy is then the
// fallback that opens nothing (classify.Fallback: the credential's class,
// else the org's default class when it is valid, else interactive; no
// rules; demotion kept when its thresholds are valid), and the gateway
// logs Err once per compiled record.
type TrafficPolicy struct {
	Policy *classify.Policy
	Err    error
	logged atomic.Bool
}

// FirstReport reports whether this is the first call for a policy with an
// error: the caller logs it then.
func (p *TrafficPolicy) FirstReport() bool { return p.Err != nil && !p.logged.Swap(true) }

func compileTraffic(o *configv1.Org) *TrafficPolicy {
	pol, err := classify.Compile(o.GetTraffic())
	if err != nil {
		return &TrafficPolicy{Policy: classify.Fallback(o.GetTraffic()), Err: err}
	}
	return &TrafficPolicy{Policy: pol}
}

// TrafficPolicy returns the compiled traffic policy of org id (nil for an
// org the catalog does not know: classify.Policy's nil value applies).
func (c *Catalog) TrafficPolicy(orgID string) *TrafficPolicy { return c.policies[orgID] }

// ModelGroup returns the model group name (nil when unknown).
func (c *Catalog) ModelGroup(name string) *configv1.ModelGroup { return c.groups[name] }
