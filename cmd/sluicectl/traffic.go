package main

import (
	"context"
	"fmt"
	"io"
	"os"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"sigs.k8s.io/yaml"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// trafficCommand manages traffic-class settings (TrafficService): each
// "set" replaces the whole settings object with a JSON or YAML file whose
// fields are those of the API message (snake_case or camelCase), e.g. for
// an org:
//
//	default_class: TRAFFIC_CLASS_INTERACTIVE
//	rules:
//	- {header: User-Agent, pattern: ^claude-code/, traffic_class: TRAFFIC_CLASS_AGENT}
//	demotion: {max_prompt_tokens: 8000, max_interactive_in_flight_per_key: 1}
func trafficCommand() *command {
	return group("traffic", "manage traffic classes: org rules and demotion, deployment reserves, caps, priority and queues", []*command{
		group("org", "an org's default class, classification rules and demotion thresholds", []*command{
			trafficGet("ORG_ID", "show an org's traffic settings", func(ctx context.Context, cl *clients, id string) (proto.Message, error) {
				r, err := call(ctx, cl.traffic.GetOrgTraffic, &adminv1.GetOrgTrafficRequest{OrgId: id})
				return r.GetTraffic(), err
			}),
			trafficSet("ORG_ID", "replace an org's traffic settings with --file", func() proto.Message { return &adminv1.OrgTraffic{} },
				func(ctx context.Context, cl *clients, id string, m proto.Message) (proto.Message, error) {
					r, err := call(ctx, cl.traffic.SetOrgTraffic, &adminv1.SetOrgTrafficRequest{OrgId: id, Traffic: m.(*adminv1.OrgTraffic)})
					return r.GetTraffic(), err
				}),
		}, "orgs"),
		group("deployment", "a deployment's interactive reserve, batch cap, prefill cap, engine priority and queue overrides", []*command{
			trafficGet("DEPLOYMENT_ID", "show a deployment's traffic settings", func(ctx context.Context, cl *clients, id string) (proto.Message, error) {
				r, err := call(ctx, cl.traffic.GetDeploymentTraffic, &adminv1.GetDeploymentTrafficRequest{DeploymentId: id})
				return r.GetTraffic(), err
			}),
			trafficSet("DEPLOYMENT_ID", "replace a deployment's traffic settings with --file", func() proto.Message { return &adminv1.DeploymentTraffic{} },
				func(ctx context.Context, cl *clients, id string, m proto.Message) (proto.Message, error) {
					r, err := call(ctx, cl.traffic.SetDeploymentTraffic, &adminv1.SetDeploymentTrafficRequest{DeploymentId: id, Traffic: m.(*adminv1.DeploymentTraffic)})
					return r.GetTraffic(), err
				}),
		}, "deployments", "dep"),
		group("model-group", "a model group's per-class queue overrides and prefill isolation", []*command{
			trafficGet("NAME", "show a model group's traffic settings", func(ctx context.Context, cl *clients, name string) (proto.Message, error) {
				r, err := call(ctx, cl.traffic.GetModelGroupTraffic, &adminv1.GetModelGroupTrafficRequest{ModelGroup: name})
				return r.GetTraffic(), err
			}),
			trafficSet("NAME", "replace a model group's traffic settings with --file", func() proto.Message { return &adminv1.ModelGroupTraffic{} },
				func(ctx context.Context, cl *clients, name string, m proto.Message) (proto.Message, error) {
					r, err := call(ctx, cl.traffic.SetModelGroupTraffic, &adminv1.SetModelGroupTrafficRequest{ModelGroup: name, Traffic: m.(*adminv1.ModelGroupTraffic)})
					return r.GetTraffic(), err
				}),
		}, "model-groups", "mg"),
	})
}

func trafficGet(arg, summary string, do func(ctx context.Context, cl *clients, id string) (proto.Message, error)) *command {
	return leaf("get", arg, summary, func(ctx context.Context, a *app, c *cmdArgs) error {
		pos, cl, p, err := a.parseConnect(a.flags(c), c, 1, 1)
		if err != nil {
			return err
		}
		m, err := do(ctx, cl, pos[0])
		if err != nil {
			return err
		}
		return p.message(m)
	})
}

func trafficSet(arg, summary string, newMsg func() proto.Message, do func(ctx context.Context, cl *clients, id string, m proto.Message) (proto.Message, error)) *command {
	return leaf("set", arg, summary, func(ctx context.Context, a *app, c *cmdArgs) error {
		fs := a.flags(c)
		file := fs.String("file", "", "JSON or YAML settings ('-': standard input); an empty object clears every setting")
		fs.StringVar(file, "f", "", "shorthand for --file")
		pos, err := a.parse(fs, c, 1, 1)
		if err != nil {
			return err
		}
		m := newMsg()
		if err := readTrafficFile(*file, m); err != nil {
			return err
		}
		cl, p, err := a.connect()
		if err != nil {
			return err
		}
		out, err := do(ctx, cl, pos[0], m)
		if err != nil {
			return err
		}
		return p.message(out)
	})
}

// readTrafficFile decodes a JSON or YAML settings file into m; unknown
// fields are errors, so a typo never silently drops a setting.
func readTrafficFile(path string, m proto.Message) error {
	if path == "" {
		return fmt.Errorf("--file is required (JSON or YAML; '-' reads standard input)")
	}
	var b []byte
	var err error
	if path == "-" {
		b, err = io.ReadAll(os.Stdin)
	} else {
		b, err = os.ReadFile(path)
	}
	if err != nil {
		return fmt.Errorf("read %s: %w", path, err)
	}
	j, err := yaml.YAMLToJSON(b)
	if err != nil {
		return fmt.Errorf("parse %s: %w", path, err)
	}
	if err := protojson.Unmarshal(j, m); err != nil {
		return fmt.Errorf("decode %s: %w", path, err)
	}
	return nil
}
