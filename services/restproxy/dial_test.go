package main

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// countingServer is a health server that counts the calls it answers.
func countingServer(t *testing.T) (string, *atomic.Int64) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	server := grpc.NewServer(grpc.UnaryInterceptor(
		func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
			calls.Add(1)
			return handler(ctx, req)
		}))
	healthpb.RegisterHealthServer(server, health.NewServer())
	go func() { _ = server.Serve(lis) }()
	t.Cleanup(server.Stop)
	return lis.Addr().String(), &calls
}

func TestAListOfReplicaAddressesIsDialledRoundRobinWithTheCairnServiceConfig(t *testing.T) {
	first, firstCalls := countingServer(t)
	second, secondCalls := countingServer(t)
	for _, addr := range []string{"ipv4:" + first + "," + second, first + "," + second} {
		firstCalls.Store(0)
		secondCalls.Store(0)
		target, resolvers := fixedAddresses("memory", addr)
		conn, err := grpc.NewClient(target, append(resolvers,
			grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithDefaultServiceConfig(serviceConfig))...)
		if err != nil {
			t.Fatalf("dialling %q: %v", addr, err)
		}
		client := healthpb.NewHealthClient(conn)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		// round_robin takes turns among the replicas that are connected; the second
		// may connect a moment after the first, so call until both answered.
		for firstCalls.Load() == 0 || secondCalls.Load() == 0 {
			if _, err := client.Check(ctx, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(true)); err != nil {
				t.Fatalf("Check through %q: %v (calls %d and %d)", addr, err, firstCalls.Load(), secondCalls.Load())
			}
		}
		cancel()
		_ = conn.Close()
	}
}

func TestASingleAddressIsStillADNSTarget(t *testing.T) {
	if target, resolvers := fixedAddresses("memory", "memory:50053"); target != "dns:///memory:50053" || resolvers != nil {
		t.Errorf("fixedAddresses(memory:50053) = %q, %v", target, resolvers)
	}
}
